# The two commands a newcomer needs (see README.md):
#   make run   - set everything up and start smolchat with the embedded default model
#   make test  - run the whole test suite (what CI runs)

CARGO ?= cargo

.PHONY: run test setup model lint bench

## Fetch the default model (idempotent, sha256-verified).
model:
	./scripts/fetch-model.sh

setup: model

run: setup
	$(CARGO) run --release -- serve

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets -- -D warnings

test: setup lint
	$(CARGO) test --all-targets

bench: setup
	$(CARGO) run --release -- --threads 2 bench --prompt-tokens 512 --gen-tokens 64 --batch 8
