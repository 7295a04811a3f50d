# Imported targets for llama.cpp: llama::ggml-base, llama::ggml, llama::llama.
#
# Default: the pinned npm packages (node-llama-cpp@3.21.1 + @node-llama-cpp/linux-x64@3.21.1,
# llama.cpp release v0.4.0). Their prebuilt libraries are linked as they are, and the headers are
# taken from the package's bundled llama.cpp source (gitRelease.bundle) at the pinned commit.
#
# VOODOO_LLAMA_DIR (cache variable or environment variable): a user's own llama.cpp instead, either
# a build tree (source checkout with libraries under build/bin) or an install prefix (include/, lib/).

set(VOODOO_LLAMA_COMMIT "80fb11ac73e66d89eae2c6a91d8a77428fa733ed")
set(VOODOO_LLAMA_RELEASE "v0.4.0")

if(NOT VOODOO_LLAMA_DIR AND DEFINED ENV{VOODOO_LLAMA_DIR})
    set(VOODOO_LLAMA_DIR "$ENV{VOODOO_LLAMA_DIR}")
endif()
set(VOODOO_LLAMA_DIR "${VOODOO_LLAMA_DIR}" CACHE PATH "A llama.cpp build or install to use instead of the pinned npm packages")

if(VOODOO_LLAMA_DIR)
    set(_inc_hints "${VOODOO_LLAMA_DIR}/include" "${VOODOO_LLAMA_DIR}/ggml/include")
    set(_common_hints "${VOODOO_LLAMA_DIR}/ggml/src" "${VOODOO_LLAMA_DIR}/include")
    set(_lib_hints "${VOODOO_LLAMA_DIR}/lib" "${VOODOO_LLAMA_DIR}/lib64" "${VOODOO_LLAMA_DIR}/build/bin"
                   "${VOODOO_LLAMA_DIR}/build/lib" "${VOODOO_LLAMA_DIR}/bin")
    set(VOODOO_LLAMA_SOURCE "VOODOO_LLAMA_DIR=${VOODOO_LLAMA_DIR}")
else()
    set(_pkg "${PROJECT_SOURCE_DIR}/node_modules")
    set(_bins "${_pkg}/@node-llama-cpp/linux-x64/bins/linux-x64")
    set(_bundle "${_pkg}/node-llama-cpp/llama/gitRelease.bundle")
    if(NOT EXISTS "${_bins}/libggml-base.so" OR NOT EXISTS "${_bundle}")
        message(FATAL_ERROR "llama.cpp libraries not found under ${_pkg}. Run `make bootstrap` "
                            "(npm ci --ignore-scripts --omit=optional), or set VOODOO_LLAMA_DIR to your own llama.cpp build.")
    endif()
    # Headers (and later the tools' sources) from the bundle, checked out once at the pinned commit.
    set(_src "${PROJECT_SOURCE_DIR}/.deps/llama.cpp")
    if(NOT EXISTS "${_src}/.voodoo-commit-${VOODOO_LLAMA_COMMIT}")
        message(STATUS "Checking out llama.cpp ${VOODOO_LLAMA_RELEASE} (${VOODOO_LLAMA_COMMIT}) from ${_bundle}")
        file(REMOVE_RECURSE "${_src}")
        find_package(Git REQUIRED)
        execute_process(COMMAND "${GIT_EXECUTABLE}" clone --quiet --no-checkout "${_bundle}" "${_src}"
                        RESULT_VARIABLE _rc)
        if(NOT _rc EQUAL 0)
            message(FATAL_ERROR "git clone of ${_bundle} failed")
        endif()
        execute_process(COMMAND "${GIT_EXECUTABLE}" -c advice.detachedHead=false checkout --quiet "${VOODOO_LLAMA_COMMIT}"
                        WORKING_DIRECTORY "${_src}" RESULT_VARIABLE _rc)
        if(NOT _rc EQUAL 0)
            message(FATAL_ERROR "llama.cpp bundle ${_bundle} does not hold the pinned commit ${VOODOO_LLAMA_COMMIT}")
        endif()
        file(TOUCH "${_src}/.voodoo-commit-${VOODOO_LLAMA_COMMIT}")
    endif()
    set(_inc_hints "${_src}/include" "${_src}/ggml/include")
    set(_common_hints "${_src}/ggml/src")
    set(_lib_hints "${_bins}")
    set(VOODOO_LLAMA_SOURCE "npm node-llama-cpp@3.21.1 (llama.cpp ${VOODOO_LLAMA_RELEASE})")
    set(VOODOO_LLAMA_SRC_DIR "${_src}" CACHE INTERNAL "")
endif()

find_path(LLAMA_INCLUDE_DIR llama.h HINTS ${_inc_hints} NO_DEFAULT_PATH)
find_path(GGML_INCLUDE_DIR ggml.h HINTS ${_inc_hints} NO_DEFAULT_PATH)
find_library(GGML_BASE_LIBRARY NAMES ggml-base HINTS ${_lib_hints} NO_DEFAULT_PATH)
find_library(GGML_LIBRARY NAMES ggml ggml.v0.4.0 HINTS ${_lib_hints} NO_DEFAULT_PATH)
find_library(LLAMA_LIBRARY NAMES llama llama.v0.4.0 HINTS ${_lib_hints} NO_DEFAULT_PATH)
# ggml-common.h (block layouts and the i-quant tables) and ggml-quants.h (the lattice grids' init functions) are not
# installed with the libraries: the GPU dequantizers and the grids built ahead read them from the source tree
# (ggml/src of a checkout).
find_path(GGML_COMMON_INCLUDE_DIR ggml-common.h HINTS ${_common_hints} NO_DEFAULT_PATH)
find_path(GGML_QUANTS_INCLUDE_DIR ggml-quants.h HINTS ${_common_hints} NO_DEFAULT_PATH)
foreach(_v LLAMA_INCLUDE_DIR GGML_INCLUDE_DIR GGML_COMMON_INCLUDE_DIR GGML_QUANTS_INCLUDE_DIR GGML_BASE_LIBRARY GGML_LIBRARY
           LLAMA_LIBRARY)
    if(NOT ${_v})
        message(FATAL_ERROR "llama.cpp: ${_v} not found (searched ${_inc_hints} ${_lib_hints}). "
                            "Point VOODOO_LLAMA_DIR at a llama.cpp build with include/ and its shared libraries, or unset it.")
    endif()
endforeach()

get_filename_component(VOODOO_LLAMA_LIB_DIR "${LLAMA_LIBRARY}" DIRECTORY)

add_library(llama::ggml-base SHARED IMPORTED)
set_target_properties(llama::ggml-base PROPERTIES IMPORTED_LOCATION "${GGML_BASE_LIBRARY}"
                      INTERFACE_INCLUDE_DIRECTORIES "${GGML_INCLUDE_DIR}")
add_library(llama::ggml SHARED IMPORTED)
set_target_properties(llama::ggml PROPERTIES IMPORTED_LOCATION "${GGML_LIBRARY}"
                      INTERFACE_LINK_LIBRARIES llama::ggml-base)
add_library(llama::llama SHARED IMPORTED)
set_target_properties(llama::llama PROPERTIES IMPORTED_LOCATION "${LLAMA_LIBRARY}"
                      INTERFACE_INCLUDE_DIRECTORIES "${LLAMA_INCLUDE_DIR}"
                      INTERFACE_LINK_LIBRARIES llama::ggml)

message(STATUS "llama.cpp: ${VOODOO_LLAMA_SOURCE}, libraries in ${VOODOO_LLAMA_LIB_DIR}")
