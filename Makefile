# Voodoo: two commands do everything on a fresh Debian 12 machine.
#   make demo   quantize the default model (stories260K) and compare with stock llama.cpp recipes
#   make test   build and run the test suite
# Both bootstrap first: Debian packages, the pinned llama.cpp npm packages, headers, configure, build.

BUILD      ?= build
JOBS       ?= $(shell nproc)
BUILD_TYPE ?= Release
SHARED     ?= ../shared
DEMO_MODEL ?= $(SHARED)/data/models/stories260K/stories260K.gguf

.PHONY: bootstrap deps build test demo bench fuzz clean

bootstrap: deps build

deps:
	bash scripts/bootstrap.sh

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE)

build: $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

test: bootstrap
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

DEMO_TEXT  ?= $(SHARED)/data/text/tinystories/tinystories_val.txt
DEMO_DIR   ?= $(BUILD)/demo

# The main job on the default model: calibrate on the first 80% of the TinyStories lines, compare on the
# held-out rest, at the size of stock Q4_K_M, beside every stock recipe llama.cpp makes for the model.
demo: bootstrap
	@mkdir -p $(DEMO_DIR)
	@n=$$(wc -l < $(DEMO_TEXT)); k=$$((n * 4 / 5)); \
	  head -n $$k $(DEMO_TEXT) > $(DEMO_DIR)/calib.txt; tail -n +$$((k + 1)) $(DEMO_TEXT) > $(DEMO_DIR)/heldout.txt
	$(BUILD)/bin/voodoo quantize $(DEMO_MODEL) --text $(DEMO_DIR)/calib.txt --eval-text $(DEMO_DIR)/heldout.txt \
	  --like Q4_K_M --ctx 256 --eval-ctx 256 --baselines all-that-fit --work $(DEMO_DIR)/work

bench: bootstrap
	cmake --build $(BUILD) -j $(JOBS) --target benches
	@for b in $(BUILD)/bin/bench_*; do echo "== $$b"; $$b; done

# The readers under libFuzzer with ASan and UBSan (clang), FUZZ_SECONDS each (issue #19): scripts/fuzz.sh.
FUZZ_SECONDS ?= 60
fuzz: bootstrap
	bash scripts/fuzz.sh $(FUZZ_SECONDS)

clean:
	rm -rf $(BUILD)
