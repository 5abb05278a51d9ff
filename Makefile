# Each target installs what it needs into a virtual environment of its own.
# torch is installed first and pinned, so no later requirement can pull another build of it.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check

.PHONY: demo test bench lint clean stress test-gpu

$(VENV)/.installed-%: setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[$*]" "$(TORCH)"
	touch $@

# The main job: two processes with sharded optimizer state (DDPShardedPlugin).
demo: $(VENV)/.installed-demo
	$(PY) examples/digits.py --devices 2

# Two workers, one test file each at a time (module-scoped fixtures stay in one process). Child processes
# fork from a warm interpreter that imported torch once (tests/helpers/warm_python.py) instead of importing
# it again; WARM_PYTHON=0 starts each cold, as a user's would. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: $(VENV)/.installed-test
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The reliability suite at full size (RELIABILITY.md): 50 SIGKILL trials per kind of save and a
# 10,000-step load run (figures in bench_results/reliability/ as JSON), then the whole resume,
# plugin-equivalence, resharding (table in bench_results/reshard_matrix.md) and model-parallel matrices
# (FULL_MATRIX=1), Lightning's own programs and the third-party corpus run under Lightning beside trainer-core
# (CORPUS_LIVE=1), and the loader fuzzer at 2,000 examples per file kind (FUZZ_SEED=N picks another draw; the
# seed is printed).
stress: $(VENV)/.installed-test
	KILL_TRIALS=50 LOAD_STEPS=10000 RELIABILITY_REPORT=bench_results/reliability \
		$(PY) -m pytest -s -p no:cacheprovider tests/reliability/test_kill_during_save.py tests/reliability/test_load.py $(PYTEST_ARGS)
	FULL_MATRIX=1 RESHARD_REPORT=bench_results/reshard_matrix.md $(PY) -m pytest -p no:cacheprovider \
		tests/checkpoint/test_resume_matrix.py tests/plugins/test_equivalence.py \
		tests/checkpoint/test_reshard_matrix.py tests/plugins/test_model_parallel.py \
		tests/checkpoint/test_lightning_checkpoint.py tests/loggers/test_mlflow.py tests/loggers/test_wandb.py \
		tests/core/test_profiler.py tests/checkpoint/test_load_memory.py tests/checkpoint/test_compile.py \
		tests/checkpoint/test_frozen_blobs.py tests/checkpoint/test_consolidate_stream.py \
		tests/plugins/test_fsdp_gather.py tests/reliability/test_elastic.py tests/reliability/test_watchdog.py \
		tests/reliability/test_slurm_requeue.py tests/callbacks/test_straggler.py tests/reliability/test_signals.py \
		tests/reliability/test_ranks.py tests/plugins/test_distributed_resume.py tests/reliability/test_fault_tolerance.py \
		tests/plugins/test_distributed.py::test_sharded_checkpoint_on_s3 tests/plugins/test_precision_distributed.py \
		tests/core/test_several_optimizers.py tests/plugins/test_pipeline.py::test_resume_across_pipeline_degrees $(PYTEST_ARGS)
	CORPUS_LIVE=1 $(PY) -m pytest -p no:cacheprovider tests/corpus $(PYTEST_ARGS)
	FUZZ_EXAMPLES=2000 $(PY) -m pytest -s -p no:cacheprovider tests/reliability/test_fuzz_loaders.py $(PYTEST_ARGS)
	PYTHON=$(PY) python3 scripts/gpu_suite.py --cpu-dry-run

# The GPU suite (tests/gpu/): nccl DDP, FSDP2 under bf16-mixed, model parallel, pipeline, pinned async
# checkpoints, CUDA RNG in exact resume, 16-mixed with the sharded scaler, two GPUs where present; each
# against one device. Under 8 minutes (a hard limit); the report goes to bench_results/gpu_report.md.
# Nothing is installed or downloaded (GPU machines may be offline): PYTHON=... picks a Python with a CUDA
# torch (default .venv/bin/python, else python3). Without CUDA it says so and every test skips;
# GPU_SUITE_ARGS=--cpu-dry-run runs the same tests on the CPU (make stress does).
test-gpu:
	python3 scripts/gpu_suite.py $(GPU_SUITE_ARGS)

# Every benchmark, each side by side with its baselines; BENCH_ARGS=--quick for a short run.
BENCHMARKS ?= import_cost overhead checkpoint ddp consolidate fsdp_checkpoint optimizer_in_backward pipeline model_parallel precision \
	load_memory object_store frozen_checkpoint recovery resume_exact
bench: $(VENV)/.installed-bench
	set -e; for b in $(BENCHMARKS); do $(PY) benchmarks/$$b.py $(BENCH_ARGS); done

lint: $(VENV)/.installed-test
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache demo_runs bench_results
