# The two commands in README: `make demo` and `make test`. Everything else is a step they call.
BUILD ?= build
JOBS ?= $(shell nproc)
MODEL_DIR := checkpoints/models/gemma3-270m
CMAKE_FLAGS ?=

.PHONY: demo test bootstrap model build fuzz clean

bootstrap:
	@tools/bootstrap.sh

model: bootstrap
	@.venv/bin/python tools/fetch_model.py --out $(MODEL_DIR)

$(BUILD)/build.ninja: CMakeLists.txt
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_FLAGS)

build: bootstrap $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS)

# The main job on the embedded default model (Gemma 3 270M), end to end.
demo: model build
	$(BUILD)/kakeya generate --model $(MODEL_DIR) --prompt "The three most important ideas in computer science are" --max-new-tokens 48
	@printf 'The lighthouse keeper wrote the weather, the ships and the oil burned into the log every night.\nOver a century the handwriting changed many times, but the order of the entries never did.\n' > $(BUILD)/demo.txt
	$(BUILD)/kakeya score --model $(MODEL_DIR) --text $(BUILD)/demo.txt --json $(BUILD)/demo-score.json

# Every test (GoogleTest via CTest, reference fixtures made by the venv's transformers).
test: model build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 1800

fuzz: build
	tools/fuzz/run_fuzz.sh all 30

clean:
	rm -rf $(BUILD)
