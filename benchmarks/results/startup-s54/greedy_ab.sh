for m in smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b; do
  for b in new base; do d=/work/main; [ $b = base ] && d=/tmp/base
    (cd $d && LLMSERVE_CACHE=/tmp/cache-$b PYTHONPATH=$d /work/main/.venv/bin/python /work/main/benchmarks/results/startup-s53/greedy_ab.py $m /tmp/greedy-$b-$m.json > /dev/null 2>&1)
  done
  cmp -s /tmp/greedy-new-$m.json /tmp/greedy-base-$m.json && echo "$m: same tokens" || echo "$m: DIFFERENT"
done
