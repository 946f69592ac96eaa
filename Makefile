# edgespec — the two commands: `make demo` and `make test`. Both start from nothing but Python.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.edgespec-installed

.PHONY: install models converter demo test test-fast replay replay-shortfalls lint bench bench-history bench-chain anchor results heads clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# The first install builds llama-cpp-python from source (about 10 minutes on 2 cores);
# pip's wheel cache makes later installs fast. The mlx extra is mlx[cpu] on Linux (the MLX tests run
# on CPU there), the Metal build on macOS. The train extra (torch, pinned) runs the head-training tests;
# plot (matplotlib) the learning-curve PNG test.
# On a CPU that reports AMX, llama.cpp is built without its AMX kernels: -march=native turns them on,
# and on VMs that do not keep AMX tile state (this project's CI VMs) the Q8_0 AMX matmul dies with
# SIGILL (tilezero, ggml_backend_amx_mul_mat). A wheel pip cached from an AMX build must be removed
# first (`pip cache remove llama_cpp_python`): the cache does not key on CMAKE_ARGS.
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_CMAKE_ARGS ?= $(if $(shell grep -sw amx_tile /proc/cpuinfo),-DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)')
$(STAMP): pyproject.toml | $(BIN)/python
	@echo "installing edgespec[llama,dev,mlx,train,serve,plot] (first time: builds llama-cpp-python, ~10 min)"
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install --progress-bar off -e ".[llama,dev,mlx,train,serve,plot]"
	@touch $(STAMP)

install: $(STAMP)

models: install
	$(BIN)/edgespec models fetch

# llama.cpp's own HF → GGUF converter, vendored in the llama-cpp-python 0.3.36 sdist: the head-conversion
# tests check edgespec's converter against it (tests/hf_head_fixtures.py; they skip without it).
LLAMA_CPP_SRC ?= $(HOME)/.cache/edgespec/src/llama.cpp-0.3.36
converter: install
	@set -e; if [ ! -f $(LLAMA_CPP_SRC)/convert_hf_to_gguf.py ]; then \
	  echo "fetching llama.cpp's converter (llama-cpp-python 0.3.36 sdist) into $(LLAMA_CPP_SRC)"; \
	  tmp=$$(mktemp -d); \
	  $(BIN)/python -m pip download --quiet --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d $$tmp; \
	  tar xzf $$tmp/llama_cpp_python-0.3.36.tar.gz -C $$tmp; \
	  src=$$tmp/llama_cpp_python-0.3.36/vendor/llama.cpp; \
	  mkdir -p $(LLAMA_CPP_SRC); \
	  cp -r $$src/convert_hf_to_gguf.py $$src/conversion $$src/gguf-py $(LLAMA_CPP_SRC); \
	  rm -rf $$tmp; \
	fi

demo: models
	$(BIN)/edgespec demo

test: models converter
	EDGESPEC_LLAMA_CPP_SRC=$(LLAMA_CPP_SRC) $(BIN)/python -m pytest -q --durations=15

test-fast: install
	$(BIN)/python -m pytest -q -m "not real and not slow"

# Every drafter's recorded traces (tests/fixtures/traces) replayed under every policy on every bundled device's
# costs (edgespec/bench/replay.py; no model, well under a minute): one table per device, then one REPLAY line.
# Other traces or devices: make replay TRACES=DIR DEVICE=NAME|FILE
replay: install
	$(BIN)/python -m edgespec.bench.replay --traces $(or $(TRACES),tests/fixtures/traces) --device $(or $(DEVICE),all)

# Where -k auto misses the gate's bounds on the frozen traces, written to the list tests/test_replay_gate.py
# holds the scheduler to (run after a scheduler change that removes misses; the list only shrinks)
replay-shortfalls: install
	$(BIN)/python -m edgespec.bench.replay --device all --shortfalls tests/fixtures/traces/shortfalls.json > /dev/null

# The default benchmark matrix (~45 min here for the Q4 pairs; the F32 and Spec-Bench pairs add ~50 min): per pair, 2 tasks per category, greedy and T=0.7,
# each speculative run alternating with a plain run; -k auto (the scheduler) beside a sweep of
# fixed γ. Writes bench/results/<pair>/ and bench/RESULTS.md.
# --no-strict: greedy mismatches (expected for the F16 target, README known limits) are reported
# loudly and counted in the tables instead of stopping the matrix.
BENCH_ARGS ?= --per-category 2 --repeats 2 --max-tokens 96 --temp 0 --temp 0.7 --no-strict
# name:target:drafter:γ values. Cost profiles first (cached): every target, and gemma3 as the
# drafter's per-token cost.
BENCH_PAIRS := smollm2-ngram:smollm2:ngram:auto,4,8,12 gemma3-ngram:gemma3:ngram:auto,4,8,12 \
               gemma3-f16-draft:gemma3-f16:gemma3:auto,2,4 gemma3-q8_0-draft:gemma3-q8_0:gemma3:auto,2,4
# The bandwidth-bound regime (F32 targets: T(8) ≈ 1.9·T(1) here, a laptop GPU's curve), at the tasks'
# own lengths (128-256 tokens): a draft model first reads the prompt, which 96 tokens rarely repay.
F32_ARGS ?= --per-category 2 --repeats 1 --temp 0 --temp 0.7 --no-strict
F32_PAIRS := smollm2-f32-ngram:smollm2-f32:ngram:auto,8 smollm2-f32-draft:smollm2-f32:smollm2:auto,4 \
             gemma3-f32-draft:gemma3-f32:gemma3:auto,4
# Spec-Bench (edgespec/bench/spec_bench, all six categories), -k auto and one fixed γ, in both regimes.
SPEC_ARGS ?= --suite spec-bench --per-category 2 --temp 0 --temp 0.7 --no-strict --ctx 4096
SPEC_PAIRS := smollm2-ngram:smollm2:ngram:auto smollm2-f32-ngram:smollm2-f32:ngram:auto \
              smollm2-f32-draft:smollm2-f32:smollm2:auto,4 gemma3-f32-draft:gemma3-f32:gemma3:auto,4
bench: models
	$(BIN)/python -m pip install --quiet "matplotlib>=3.8"
	@set -e; for spec in $(BENCH_PAIRS) $(F32_PAIRS); do \
	  name=$${spec%%:*}; rest=$${spec#*:}; target=$${rest%%:*}; rest=$${rest#*:}; drafter=$${rest%%:*}; \
	  ks=$$(echo $${rest#*:} | sed 's/,/ -k /g'); \
	  case " $(F32_PAIRS) " in *" $$spec "*) args="$(F32_ARGS)";; *) args="$(BENCH_ARGS)";; esac; \
	  $(BIN)/edgespec profile --model $$target --drafter none --repeats 3 > /dev/null; \
	  $(BIN)/edgespec bench --target $$target --drafter $$drafter -k $$ks $$args --out bench/results/$$name; \
	done; \
	for spec in $(SPEC_PAIRS); do \
	  name=$${spec%%:*}; rest=$${spec#*:}; target=$${rest%%:*}; rest=$${rest#*:}; drafter=$${rest%%:*}; \
	  ks=$$(echo $${rest#*:} | sed 's/,/ -k /g'); \
	  $(BIN)/edgespec bench --target $$target --drafter $$drafter -k $$ks $(SPEC_ARGS) --out bench/results/spec-bench/$$name; \
	done
	$(MAKE) --no-print-directory results

# The history drafter against ngram (#33), both -k auto, in both regimes (an F32 and a Q4 target),
# greedy: the session suites (each session cold at its start, history carried across its turns),
# Spec-Bench and the shipped suite (each run cold); then its index memory and drafting time at 1M
# tokens. ~75 min here. Writes bench/results/history/<target>-<suite>/ and bench/results/history-cost/.
HISTORY_TARGETS := smollm2-f32 smollm2
HISTORY_SUITES := edit-session:6 agent-loop:6 spec-bench:2 shipped:2
bench-history: models
	$(BIN)/python -m pip install --quiet "matplotlib>=3.8"
	@set -e; for t in $(HISTORY_TARGETS); do for s in $(HISTORY_SUITES); do \
	  $(BIN)/edgespec bench --target $$t --drafter history --drafter ngram -k auto --suite $${s%%:*} \
	    --per-category $${s#*:} --temp 0 --ctx 4096 --no-strict --out bench/results/history/$$t-$${s%%:*}; \
	done; done
	$(BIN)/python bench/history_cost.py --out bench/results/history-cost
	$(MAKE) --no-print-directory results

# A drafter chain against its members alone (docs/scheduler.md "Drafter chains"), ~15 min.
bench-chain: models
	$(BIN)/python -m pip install --quiet "matplotlib>=3.8"
	$(BIN)/edgespec bench --target smollm2-f32 --drafter ngram --drafter smollm2 --drafter ngram,smollm2 -k auto \
	  --suite shipped --per-category 2 --repeats 3 --temp 0 --ctx 4096 --no-strict --out bench/results/chain/smollm2-f32-shipped
	$(MAKE) --no-print-directory results

# llama.cpp's native llama-speculative-simple on the same pairs, tasks and token budget (built
# outside the repository, ~10 min the first time), each task's native runs followed by edgespec
# -k auto on the same pair (paired ratios): bench/results/<pair>/native_anchor.json, then
# bench/RESULTS.md re-assembled. Run on an idle machine.
ANCHOR_ARGS ?= --per-category 2 --max-tokens 96 --repeats 3
ANCHOR_PAIRS := smollm2-ngram gemma3-f16-draft smollm2-f32-draft gemma3-f32-draft
anchor: models
	@set -e; bench/anchors/build.sh > /dev/null; M=$${EDGESPEC_HOME:-$$HOME/.cache/edgespec}/models; \
	$(BIN)/python bench/anchors/native.py --target $$M/SmolLM2-135M-Instruct.Q4_1.gguf --drafter ngram --edgespec-auto \
	  --n-max 0 --n-max 4 --n-max 8 --n-max 12 $(ANCHOR_ARGS) --out bench/results/smollm2-ngram/native_anchor.json; \
	$(BIN)/python bench/anchors/native.py --target $$M/gemma-3-270m-f16.gguf --drafter $$M/gemma-3-270m-q4_k_m.gguf \
	  --edgespec-auto --n-max 0 --n-max 2 --n-max 4 --n-max 8 $(ANCHOR_ARGS) --out bench/results/gemma3-f16-draft/native_anchor.json; \
	for pair in smollm2-f32-draft:SmolLM2-135M-Instruct.F32.gguf:SmolLM2-135M-Instruct.Q4_1.gguf \
	            gemma3-f32-draft:gemma-3-270m-f32.gguf:gemma-3-270m-q4_k_m.gguf; do \
	  name=$${pair%%:*}; rest=$${pair#*:}; \
	  $(BIN)/python bench/anchors/native.py --target $$M/$${rest%%:*} --drafter $$M/$${rest#*:} --edgespec-auto \
	    --n-max 0 --n-max 3 --n-max 5 $(ANCHOR_ARGS) --out bench/results/$$name/native_anchor.json; \
	done
	$(MAKE) --no-print-directory results

# llama-server's own model-free n-gram speculation (ngram-mod, ngram-map-k, ngram-cache) against edgespec
# serve's history drafter (and both plain), on the session suites, one server at a time, 2 rounds in
# alternating order (bench/anchors/README.md). llama-server is built outside the repository the first time
# (~7 min here). F32 target: the bandwidth-bound regime; Q4_1 (smollm2): compute-bound. Writes
# bench/results/server-anchor/<model>-<suite>.json. Run on an idle machine.
ANCHOR_SERVER_ARGS ?= --rounds 2
ANCHOR_SERVER_MODELS := smollm2-f32:SmolLM2-135M-Instruct.F32.gguf smollm2:SmolLM2-135M-Instruct.Q4_1.gguf
.PHONY: anchor-server
anchor-server: models
	@set -e; bench/anchors/build.sh llama-server > /dev/null; M=$${EDGESPEC_HOME:-$$HOME/.cache/edgespec}/models; \
	mkdir -p bench/results/server-anchor; \
	for model in $(ANCHOR_SERVER_MODELS); do \
	  for suite in edit-session agent-loop; do \
	    $(BIN)/python bench/anchors/server_anchor.py --target $$M/$${model#*:} --suite $$suite $(ANCHOR_SERVER_ARGS) \
	      --out bench/results/server-anchor/$${model%%:*}-$$suite.json; \
	  done; \
	done

# bench/RESULTS.md, assembled from the result folders `make bench` and `make anchor` write (runs
# nothing; a folder that is missing is left out): every pair's results.md, then the Spec-Bench
# pairs', then the paired native anchors. Nothing else goes into RESULTS.md: analyses and one-off
# runs are in docs/results.md and docs/experiments/.
results:
	@set -e; out=bench/RESULTS.md; py=$(BIN)/python; [ -x $$py ] || py=$(PYTHON); \
	printf '# edgespec benchmark results\n\nAssembled by `make results` from bench/results/ (`make bench` and `make anchor` run it\nafter their runs). Each section is one run: its command, machine and date are in the section.\nAnalyses and other runs: docs/results.md and docs/experiments/.\n\n' > $$out; \
	for spec in $(BENCH_PAIRS) $(F32_PAIRS); do \
	  name=$${spec%%:*}; [ -f bench/results/$$name/results.md ] || continue; \
	  sed -e "s|^# |## $$name: |" -e 's|^## temperature|### temperature|' -e "s|](\([a-z_0-9.]*\.png\))|](results/$$name/\1)|" \
	    bench/results/$$name/results.md >> $$out; \
	done; \
	for spec in $(SPEC_PAIRS); do \
	  name=$${spec%%:*}; [ -f bench/results/spec-bench/$$name/results.md ] || continue; \
	  sed -e "s|^# |## Spec-Bench, $$name: |" -e 's|^## temperature|### temperature|' -e "s|](\([a-z_0-9.]*\.png\))|](results/spec-bench/$$name/\1)|" \
	    bench/results/spec-bench/$$name/results.md >> $$out; \
	done; \
	for t in $(HISTORY_TARGETS); do for s in $(HISTORY_SUITES); do \
	  d=bench/results/history/$$t-$${s%%:*}; [ -f $$d/results.md ] || continue; \
	  sed -e "s|^# edgespec bench — |## History vs ngram ($${s%%:*}): |" -e 's|^## temperature|### temperature|' \
	    -e "s|](\([a-z_0-9.]*\.png\))|]($${d#bench/}/\1)|" $$d/results.md >> $$out; \
	done; done; \
	[ ! -f bench/results/history-cost/results.md ] || sed -e 's|^# |## |' bench/results/history-cost/results.md >> $$out; \
	d=bench/results/chain/smollm2-f32-shipped; [ ! -f $$d/results.md ] || sed -e "s|^# edgespec bench — |## Chain ngram,smollm2 vs its members: |" \
	  -e 's|^## temperature|### temperature|' -e "s|](\([a-z_0-9.]*\.png\))|]($${d#bench/}/\1)|" $$d/results.md >> $$out; \
	for f in bench/results/server-anchor/*.json; do [ -f $$f ] || continue; \
	  printf '\n## Anchor: llama-server n-gram types vs edgespec serve (%s)\n\n' $$(basename $$f .json) >> $$out; \
	  $$py bench/anchors/server_report.py $$f | sed -e 's|^### |### |' >> $$out; \
	done; \
	printf '\n## Anchor: native llama.cpp llama-speculative-simple (greedy, same tasks and tokens)\n\n' >> $$out; \
	printf 'Each (task, repeat): native at every n-max, then edgespec `-k auto` on the same pair, back to back\n(`bench/anchors/native.py --edgespec-auto`; table: `python -m edgespec.bench.anchor_compare FILE`).\n\n' >> $$out; \
	for pair in $(ANCHOR_PAIRS); do \
	  f=bench/results/$$pair/native_anchor.json; [ -f $$f ] || continue; \
	  printf '### %s\n\n' $$pair >> $$out; \
	  $$py -m edgespec.bench.anchor_compare $$f >> $$out; \
	  echo >> $$out; \
	done

# The trained heads (models/; the repository keeps the two SmolLM2 heads the tests use, models/README.md):
# fixed seed, data and step counts (the budget is only a cap), 1 thread as they were trained; feature
# caches and checkpoints go to $EDGESPEC_HOME/train/. Not part of `make test`. Here: EAGLE-3 SmolLM2 feature extraction ~25 min + 1470 steps in 44 min; Gemma-3 ~35 min (its prompts
# framed "Question: …\nAnswer:", as bench feeds this template-less model) + 963 steps in 37 min (side by side with
# the DFlash run, one thread each); DFlash 2000 / 1200 steps in 11 / 8 min,
# DSpark 800 steps in 2 / 3 min. Torch's float reductions make a rerun
# equal up to rounding, not bit for bit.
SMOLLM2_HEAD_STEPS ?= 1470
GEMMA3_HEAD_STEPS ?= 963
HEAD_ARGS ?= --kind eagle3 --seed 0 --draft-vocab 8192 --lr 2e-3 --threads 1 --budget-min 300
# DFlash heads reuse the EAGLE-3 runs' feature caches (same layers and data), block 8, one
# layer, linear LR decay to 0 at the last step; DSpark = Markov + confidence heads trained on the frozen
# DFlash head.
DFLASH_ARGS ?= --kind dflash --seed 0 --draft-vocab 8192 --lr 2e-3 --lr-decay --threads 1 --budget-min 300
DSPARK_ARGS ?= --kind dspark --seed 0 --draft-vocab 8192 --lr 2e-3 --lr-decay --threads 1 --budget-min 300
heads: models
	$(BIN)/edgespec train-head --target smollm2 --out models/smollm2-135m-eagle3.gguf --max-steps $(SMOLLM2_HEAD_STEPS) --corpus-chars 300000 $(HEAD_ARGS)
	$(BIN)/edgespec train-head --target gemma3 --out models/gemma3-270m-eagle3.gguf --max-steps $(GEMMA3_HEAD_STEPS) --corpus-chars 60000 $(HEAD_ARGS)
	$(BIN)/edgespec train-head --target smollm2 --out models/smollm2-135m-dflash.gguf --max-steps 2000 --corpus-chars 300000 $(DFLASH_ARGS)
	$(BIN)/edgespec train-head --target gemma3 --out models/gemma3-270m-dflash.gguf --max-steps 1200 --corpus-chars 60000 $(DFLASH_ARGS)
	$(BIN)/edgespec train-head --target smollm2 --out models/smollm2-135m-dspark.gguf --base models/smollm2-135m-dflash.gguf --max-steps 800 --corpus-chars 300000 $(DSPARK_ARGS)
	$(BIN)/edgespec train-head --target gemma3 --out models/gemma3-270m-dspark.gguf --base models/gemma3-270m-dflash.gguf --max-steps 800 --corpus-chars 60000 $(DSPARK_ARGS)

lint: install
	$(BIN)/ruff check edgespec tests bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
