# The two commands a newcomer needs (see README.md):
#   make run   - set everything up and start smolchat with the embedded default model
#   make test  - run the whole test suite (what CI runs)

CARGO ?= cargo

.PHONY: run test setup model lint bench test-deps fuzz soak

## Fetch the default model (idempotent, sha256-verified).
model:
	./scripts/fetch-model.sh

setup: model

run: setup
	$(CARGO) run --release -- serve

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets -- -D warnings

## Chromium + chromedriver for the browser tests (tests/browser.rs); apt-get when missing.
test-deps:
	./scripts/install-test-deps.sh

test: setup test-deps lint
	$(CARGO) test

bench: setup
	$(CARGO) run --release -- --threads 2 bench --prompt-tokens 512 --gen-tokens 64 --batch 8

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
