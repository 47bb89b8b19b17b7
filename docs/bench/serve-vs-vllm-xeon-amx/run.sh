# The same run on an Intel Xeon with AMX: ../serve-vs-vllm-epyc-avx512/run.sh as it is, its
# output and vLLM's bench wrapper moved. vbench.py is four lines: p = argparse.ArgumentParser(),
# vllm.benchmarks.serve.add_cli_args(p), vllm.benchmarks.serve.main(p.parse_args()).
OUT=/tmp/serve VBENCH=/tmp/vbench.py bash "$(dirname "$0")/../serve-vs-vllm-epyc-avx512/run.sh"
