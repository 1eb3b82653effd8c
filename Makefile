# The two commands a newcomer needs (see README.md):
#   make run   - set everything up and start smolchat with the embedded default model
#   make test  - run the whole test suite (what CI runs)
#   make cuda  - the GPU binary (CUDA 13.0 toolkit installed into a cache when missing)

CARGO ?= cargo

.PHONY: run test mount-check setup model lint lint-cuda bench bench-replicas test-deps cuda cuda-toolkit cuda-tests gpu-bundle llama-tarball gpu-check gpu-lease fuzz soak

# The `cuda` feature builds in its own target directory: its candle-core, cudarc and
# candle-kernels (nvcc) artifacts never replace the CPU build's, and the GPU binary can never be
# taken for the CPU one (it needs libcuda.so.1 to start, which CPU machines lack).
CUDA_TARGET_DIR ?= target/cuda
# Runs a cargo command with the cached toolkit's environment (scripts/cuda-env.sh).
CUDA_CARGO = eval "$$(scripts/cuda-env.sh)" && CARGO_TARGET_DIR=$(CUDA_TARGET_DIR) $(CARGO)

## Fetch the default model (idempotent, sha256-verified).
model:
	./scripts/fetch-model.sh

setup: model

run: setup
	$(CARGO) run --release -- serve

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	python3 scripts/check-layers.py

## CUDA 13.0 compiler, headers and libraries from PyPI wheels into
## $${SMOLCHAT_CUDA_ROOT:-~/.cache/smolchat/cuda13}; does nothing when already installed.
cuda-toolkit:
	./scripts/setup-cuda13-toolchain.sh >/dev/null

## Compiles and lints the `cuda` feature (PTX and MMQ objects for sm_90 included), so GPU code
## cannot rot on machines without a GPU. In the CPU build's target directory: a check makes no
## binary that could be taken for the CPU one, and every dependency whose features the `cuda`
## feature leaves alone is checked once for both lints (about 30 crates are checked again, not
## every dependency: minutes of CI on two cores).
lint-cuda: cuda-toolkit
	eval "$$(scripts/cuda-env.sh)" && $(CARGO) clippy --workspace --all-targets --features cuda -- -D warnings

## The GPU binary: target/cuda/release/smolchat (see README, "GPU build").
cuda: cuda-toolkit
	$(CUDA_CARGO) build --release --features cuda

## Test binaries with the `cuda` feature, to carry to a GPU machine (tests/gpu.rs runs there).
cuda-tests: cuda-toolkit
	$(CUDA_CARGO) test --workspace --no-run --features cuda

## What `make gpu-check` runs on a GPU machine (no cargo there): the release binary and the GPU
## test binary, built with the `cuda` feature, stripped and xz-compressed into target/gpu-bundle
## (carry it; see README, "GPU build and gpu-check").
gpu-bundle: cuda cuda-tests
	@mkdir -p target/gpu-bundle
	@eval "$$(scripts/cuda-env.sh)" && CARGO_TARGET_DIR=$(CUDA_TARGET_DIR) $(CARGO) test --no-run --features cuda --test gpu --message-format=json 2>/dev/null \
	  | python3 -c 'import json,sys; [print(m["executable"]) for m in map(json.loads, sys.stdin) if m.get("executable") and m["target"]["name"] == "gpu"]' \
	  | head -1 | xargs -I{} cp {} target/gpu-bundle/gpu-tests
	cp $(CUDA_TARGET_DIR)/release/smolchat target/gpu-bundle/smolchat
	strip target/gpu-bundle/smolchat target/gpu-bundle/gpu-tests
	xz -9 -f -T0 target/gpu-bundle/smolchat target/gpu-bundle/gpu-tests
	@c=$$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown); \
	  git diff --quiet HEAD 2>/dev/null || c="$$c-dirty"; echo "$$c" > target/gpu-bundle/commit
	@ls -l target/gpu-bundle

## A llama.cpp source tarball for gpu-check's `llama` phase, from a git directory holding b9793
## (LLAMA_GIT=/path/to/llama.cpp.git; README, "GPU build and gpu-check").
LLAMA_GIT ?=
LLAMA_REV ?= HEAD
llama-tarball:
	@test -n "$(LLAMA_GIT)" || { echo "set LLAMA_GIT to a llama.cpp git directory"; exit 2; }
	@mkdir -p target/gpu-bundle
	git --git-dir=$(LLAMA_GIT) archive --format=tar.gz --prefix=llama.cpp/ -o target/gpu-bundle/llama.cpp.tar.gz $(LLAMA_REV)
	@ls -l target/gpu-bundle/llama.cpp.tar.gz

## One GPU lease in one call, on a machine with a GPU and the CUDA 13 libraries, from the
## bundle: the phases in priority order within GPU_LEASE_BUDGET seconds (each skipped when the
## budget left is below its estimate), the report rewritten after each phase into
## $${OUT:-target/gpu-lease}/gpu-lease.{json,md} and raw.tar.xz; exit status 1 when a phase
## failed, the first line saying why (README, "GPU build and gpu-check").
GPU_LEASE_BUDGET ?= 480
gpu-lease:
	@scripts/gpu-check.sh lease --budget $(GPU_LEASE_BUDGET) $(if $(OUT),--out $(OUT))

## Every phase back to back, then the report in $${OUT:-target/gpu-check}/gpu-check.{json,md};
## exit status 1 when a phase failed. Phases one by one: scripts/gpu-check.sh PHASE (each
## within 10 minutes).
gpu-check:
	scripts/gpu-check.sh all --tarball target/gpu-bundle/llama.cpp.tar.gz

## Chromium + chromedriver (browser tests), PostgreSQL and nginx (store and replica tests);
## apt-get when missing.
test-deps:
	./scripts/install-test-deps.sh

## The whole suite. A private PostgreSQL server (scripts/test-postgres.sh) runs for its duration:
## the store tests and the replica tests run on it as well as on SQLite.
## Whether this process may mount a tmpfs (the storage-fault tests need it); first, so a machine
## that cannot is told before the build.
mount-check:
	./scripts/check-mount.sh

## Incremental compilation is off (unless CARGO_INCREMENTAL is set): a fresh clone gains nothing
## from it, and its caches for ~60 test crates took several GB more than a CI machine had free
## (CI failed with "No space left on device" linking the tests).
## Skips are failures here: PostgreSQL (SMOLTEST_REQUIRE_POSTGRES), nginx (SMOLTEST_REQUIRE_NGINX), tmpfs mounts for
## the storage faults (SMOLTEST_REQUIRE_MOUNT, checked before the build by scripts/check-mount.sh),
## and the CUDA compiler for the kernels' static checks (SMOLTEST_REQUIRE_NVCC; installed by
## lint-cuda's cuda-toolkit).
test: export CARGO_INCREMENTAL ?= 0
test: mount-check setup test-deps lint lint-cuda
	@url="$$(./scripts/test-postgres.sh start)" || exit 1; \
	SMOLTEST_DATABASE_URL="$$url" SMOLTEST_REQUIRE_POSTGRES=1 SMOLTEST_REQUIRE_NGINX=1 SMOLTEST_REQUIRE_MOUNT=1 SMOLTEST_REQUIRE_NVCC=1 SMOLTEST_REQUIRE_SYSTEMD=1 $(CARGO) test --workspace; rc=$$?; \
	./scripts/test-postgres.sh stop; exit $$rc

bench: setup
	$(CARGO) run --release -- --threads 2 bench --prompt-tokens 512 --gen-tokens 64 --batch 8

## Warm-cache share of later turns with conversation affinity vs random routing: three replicas
## on a private PostgreSQL behind nginx (docs/BENCHMARKS.md, "Replicas").
bench-replicas: setup test-deps
	@url="$$(./scripts/test-postgres.sh start)" || exit 1; \
	SMOLTEST_DATABASE_URL="$$url" SMOLTEST_REQUIRE_POSTGRES=1 $(CARGO) test --test replicas -- --ignored --nocapture; rc=$$?; \
	./scripts/test-postgres.sh stop; exit $$rc

## Long fuzzing run of every parser of outside input (tests/fuzz.rs; `make test` runs 256 cases
## per property). FUZZ_CASES sets the number of cases per property.
FUZZ_CASES ?= 20000
fuzz: setup
	PROPTEST_CASES=$(FUZZ_CASES) $(CARGO) test --test fuzz -- --test-threads 2

## Long crash soak: SOAK_KILLS random SIGKILLs of the server under writers (tests/reliability.rs;
## `make test` runs 5).
SOAK_KILLS ?= 40
soak: setup
	SMOLCHAT_SOAK_KILLS=$(SOAK_KILLS) $(CARGO) test --test reliability -- --nocapture
