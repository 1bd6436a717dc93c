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

# Release, not RelWithDebInfo: debug info makes a LibTorch translation unit's object ~25x larger
# and its compile ~1.6x slower (infer/long_eval.cpp: 60 s against 36 s on a 2-core machine), the
# larger part of a fresh clone's CI time. CMAKE_FLAGS=-DCMAKE_BUILD_TYPE=RelWithDebInfo for a debugger.
$(BUILD)/build.ninja: CMakeLists.txt
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

build: bootstrap $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS)

# The whole product on the embedded default model (Gemma 3 270M): generate + score, the
# training loop at toy scale (capture -> f_θ -> codec calibration), decode sessions (ar vs
# restored, memory tables), a short NIAH ladder and an alpha sweep; summary and plots in
# $(BUILD)/demo/ (tools/demo.sh; < 30 minutes on a 2-core CPU after the downloads).
demo: model build
	BUILD=$(BUILD) tools/demo.sh

# Every test (GoogleTest via CTest, reference fixtures made by the venv's transformers).
# ctest runs JOBS tests at once, so each gets one intra-op thread: LibTorch's OpenMP pool sized
# to every core in each of JOBS processes oversubscribes the machine (two Fused tests side by
# side on 2 cores: 39 s each with the default pool, 13 s each with one thread).
test: model build
	cd $(BUILD) && OMP_NUM_THREADS=1 ctest --output-on-failure -j $(JOBS) --timeout 1800

fuzz: build
	tools/fuzz/run_fuzz.sh all 30

clean:
	rm -rf $(BUILD)
