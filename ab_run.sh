#!/usr/bin/env bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
T0=$(date +%s)
T=tests/test_gpu_engine.py::test_prompts_from_scratch_replay_their_own_prefill_graphs
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE $T > $OUT/a.log 2>&1; echo "with kernel rc $? at $(( $(date +%s) - T0 )) s"
grep -E "^E |assert|Error" $OUT/a.log | head -30
patch -s -R -p1 < ab.patch
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE $T > $OUT/b.log 2>&1; echo "without kernel rc $? at $(( $(date +%s) - T0 )) s"
grep -E "^E |assert|Error" $OUT/b.log | head -30
patch -s -p1 < ab.patch
timeout $(( 470 - ($(date +%s) - T0) )) python3 -m pytest -q -p no:cacheprovider -rfE --durations=10 "tests/test_gpu_qwen3_5.py::test_bfloat16_logits_close_to_transformers" tests/test_gpu_moe.py > $OUT/c.log 2>&1; echo "rest rc $? at $(( $(date +%s) - T0 )) s"
tail -25 $OUT/c.log
