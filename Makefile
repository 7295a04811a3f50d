# Voodoo: two commands do everything on a fresh Debian 12 machine.
#   make demo   quantize the default model (stories260K) and compare with stock llama.cpp recipes
#   make test   build and run the test suite
# Both bootstrap first: Debian packages, the pinned llama.cpp npm packages, headers, configure, build.

BUILD      ?= build
JOBS       ?= $(shell nproc)
BUILD_TYPE ?= Release
SHARED     ?= ../shared
DEMO_MODEL ?= $(SHARED)/data/models/stories260K/stories260K.gguf

.PHONY: bootstrap deps build test demo bench clean

bootstrap: deps build

deps:
	bash scripts/bootstrap.sh

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE)

build: $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

test: bootstrap
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

demo: bootstrap
	$(BUILD)/bin/voodoo inspect $(DEMO_MODEL)

bench: bootstrap
	cmake --build $(BUILD) -j $(JOBS) --target benches
	@for b in $(BUILD)/bin/bench_*; do echo "== $$b"; $$b; done

clean:
	rm -rf $(BUILD)
