#!/usr/bin/env bash
# The H200 runs the open issues still need, in the order they pay off, each bounded by a timeout so one
# device call (10 minutes) can take the first few: STEPS="replay sweep" bash bench/h200_open_items.sh.
# Results go to $OUT (JSON rows and logs). Steps:
#   replay    issue 10: the 8 x 24 x 2,000 replay in the three modes (GPU busy of the last round)   ~200 s
#   long      issue 10: the long variant, 4 x 28 x 4,000                                            ~100 s
#   host      issue 10: where the engine thread's time goes in kv_drop's last round                  ~120 s
#   sweep     issue 10: decode at batch 1, 128, 256, greedy and sampled (the q/k/v and add+norm fusions) ~90 s
#   mxfp4     issue 12: MXFP4 kernel variants incl. the "swap" mode                                 ~180 s
#   gemv      issue 12: the GEMV variants (CUDA-core strips, tensor-core mma), their reads alone    ~90 s
#   grouped   issue 12: the grouped tensor-core GEMM (mxfp4_mma_grouped.py) at 8-4,096 tokens      ~250 s
#   dummy120  issue 12: gpt-oss-120b (dummy MXFP4) decode at batch 1, 64, 256, and its KV pool        ~240 s
#   dummy20   issue 12: gpt-oss-20b (dummy MXFP4) decode at batch 1, 64, 256                         ~150 s
#   k512      issue 12: gpt-oss-20b (dummy MXFP4) at batch 256 and 512, prompt 1,024: the step kernels ~150 s
#   prefill20 issue 12: gpt-oss-20b (dummy MXFP4) prefill of 128 x 1,024 tokens, chunk 16,384: its kernels    ~80 s
#   throughput issue 12: 512 x 1k in / 1k out, MXFP4 (dummy 20b) beside bf16 (bench/throughput.py) ~300 s
#   ids       issue 12: the same run, MXFP4 only, token ids only (--no-detokenize, as trtllm-bench)   ~70 s
#   transfer  issue 14 (nvidia-h200-x2): the prefill->decode KV transfer against plain NCCL sends, bf16 and fp8 ~60 s
#   tp120     issue 14 (nvidia-h200-x2): gpt-oss-120b decode at batch 1 and 64, TP 1 then TP 2        ~400 s
#   minimax   issue 14 (nvidia-h200-x2): MiniMax-M2 full shape (dummy FP8) at EP 2, batch 1 and 64   ~400 s
#   pdreplay  issue 14 (nvidia-h200-x2): agent replay at 8 and 16 agents, prefill/decode pair vs colocated ~500 s
#   kill      issue 14 (nvidia-h200-x2): a worker (decode, then prefill) killed mid-run, 20b dummy      ~200 s
#   ceiling   issue 12: how fast one kernel can read 3-1024 MB (the floor of a decode GEMV's size)   ~30 s
#   fp8       issue 12: MiniMax-M2 FP8 projections and MoE (GEMV, x-in-asm, tensor cores), 8 layers  ~60 s
#   gemvs     issue 12: the one-token GEMVs' strip shapes: FP8 (MiniMax-M2), bf16 (gpt-oss q/k/v, o) vs cuBLAS ~200 s
#   pdl       issue 12: gpt-oss-120b (dummy) and 20b decode at batch 1 and 64, without then with EngineConfig.pdl ~300 s
#   cublas    issue 12: gpt-oss-20b and 120b (dummy) at batch 1, the bf16 projections' GEMV then cuBLAS   ~200 s
#   sort      issue 12: the counting sort, one program against a program per chunk, at 64-1,024 tokens ~40 s
#   tiled     issue 12: the MXFP4 GEMV (1, 4 tokens), grouped GEMMs (64-1,024; prefill 4,096) on tiles (mxfp4_layout.py), kernels (err column) ~160 s
#   b1        issue 12: gpt-oss-120b (dummy MXFP4) at batch 1 with its kernel table, 20,000-token pool (fits an H100) ~150 s
#   gputests  issue 12: the GPU tests of the model, the MXFP4 and FP8 kernels, routing, norms and RoPE (test_model_gpu.py, test_ops_{mxfp4,routing,fp8,kv_store}.py; compiles: ~350 s)
#   serve     issue 10/11: the HTTP replay with the piece cache (bench/serve_replay.sh; needs wheels) ~400 s
# The GPT-OSS tokenizer cannot be built there (no quicktok): carry a MINAKV_CACHE holding o200k/ (see
# bench/serve_replay.sh) for `serve`; the other steps need no tokenizer.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
STEPS=${STEPS:-replay sweep mxfp4}
for step in $STEPS; do
    log="$OUT/$step.log"
    echo "=== $step ($(date -u +%H:%M:%S)), log: $log"
    case $step in
        replay) timeout 300 python3 bench/agent_replay.py --modes plain,kv_drop,text_drop --gaps ;;
        long) timeout 200 python3 bench/agent_replay.py --agents 4 --rounds 28 --tool-tokens 4000 --modes plain,kv_drop ;;
        host) timeout 200 python3 bench/agent_replay.py --modes kv_drop --sample-host ;;
        sweep) timeout 200 python3 bench/decode_sweep.py --batches 1,128,256 --prompt 400 --repeats 2 ;;
        mxfp4) timeout 240 python3 bench/mxfp4_variants.py --out "$OUT/mxfp4_variants.json" ;;
        gemv) timeout 200 python3 bench/mxfp4_variants.py --tokens 1,8,64 --only gemv --out "$OUT/gemv_variants.json" ;;
        grouped) timeout 300 python3 bench/mxfp4_variants.py --tokens 8,16,64,256,512,1024,4096 --budget-s 240 \
            --only "mma grouped,u4 split 1,fused default,grouped default,bf16 once,bf16 fused,bf16 grouped" --out "$OUT/grouped_mma.json" ;;
        dummy120) timeout 300 python3 bench/decode_sweep.py --dummy gpt-oss-120b --batches 1,64,256 --prompt 400 --repeats 1 --kv-tokens 320000 --kernels ;;
        dummy20) timeout 200 python3 bench/decode_sweep.py --dummy gpt-oss-20b --batches 1,64,256 --prompt 400 --repeats 1 ;;
        k512) timeout 200 python3 bench/decode_sweep.py --dummy gpt-oss-20b --batches 256,512 --prompt 1024 --n1 64 --n2 160 --max-num-batched-tokens 16384 --repeats 1 --modes greedy --kernels ;;
        prefill20) timeout 200 python3 bench/prefill_long.py --dummy gpt-oss-20b --lengths 1024 --requests 128 --chunk 16384 --kernels ;;
        throughput) timeout 400 python3 bench/throughput.py ;;
        ids) timeout 200 python3 bench/throughput.py --paths mxfp4 --no-detokenize --sample-host --kernels ;;
        transfer) timeout 200 python3 bench/pd_transfer.py && timeout 200 python3 bench/pd_transfer.py --kv-fp8 ;;
        tp120) for tp in 1 2; do  # (decode_sweep_tp1.json, then the loop below names the TP 2 rows)
                timeout 280 python3 bench/decode_sweep.py --dummy gpt-oss-120b --batches 1,64 --prompt 400 \
                    --repeats 1 --kv-tokens 60000 --tp $tp
                [ $tp = 1 ] && mv "$OUT/decode_sweep.json" "$OUT/decode_sweep_tp1.json"
            done ;;
        minimax) timeout 500 python3 bench/decode_sweep.py --dummy minimax-m2 --batches 1,64 --prompt 400 \
            --repeats 1 --kv-tokens 20000 --ep 2 ;;
        pdreplay) timeout 580 python3 bench/pd_replay.py --agents 8,16 --rounds 8 ;;
        kill) timeout 300 python3 bench/kill_worker.py --dummy --side decode && \
            timeout 300 python3 bench/kill_worker.py --dummy --side prefill ;;
        ceiling) timeout 120 python3 bench/read_ceiling.py ;;
        fp8) timeout 300 python3 bench/bench_fp8.py --tokens 1,4,64 --layers 8 ;;
        gemvs) timeout 230 python3 bench/gemv_sweep.py --budget-s 180 ;;
        pdl) for model in gpt-oss-20b gpt-oss-120b; do for pdl in off on; do  # four row files, named here
                timeout 150 python3 bench/decode_sweep.py --dummy $model --batches 1,64 --prompt 400 --repeats 1 \
                    --kv-tokens 60000 $([ $pdl = off ] && echo --no-pdl)
                mv "$OUT/decode_sweep.json" "$OUT/decode_sweep_${model}_pdl_$pdl.json"
            done; done ;;
        cublas) for model in gpt-oss-20b gpt-oss-120b; do for proj in gemv cublas; do  # four row files
                timeout 150 python3 bench/decode_sweep.py --dummy $model --batches 1 --prompt 400 --repeats 2 \
                    --kv-tokens 60000 $([ $proj = cublas ] && echo --cublas)
                mv "$OUT/decode_sweep.json" "$OUT/decode_sweep_${model}_$proj.json"
            done; done ;;
        tiled) timeout 240 python3 bench/mxfp4_variants.py --tokens 1,4,64,256,1024,4096 \
                --only "gemv mma u4 split 1,mma grouped,grouped scaled" --out "$OUT/variants_tiled.json" ;;
        sort) timeout 120 python3 bench/moe_variants.py --tokens 64,256,512,1024 --only none --budget 0 \
            --out "$OUT/moe_sort.json" ;;
        b1) timeout 200 python3 bench/decode_sweep.py --dummy gpt-oss-120b --batches 1 --prompt 400 --repeats 2 \
            --modes greedy --kv-tokens 20000 --kernels ;;
        gputests) for t in test_model_gpu test_ops_mxfp4 test_ops_routing test_ops_fp8 test_ops_kv_store; do
                # a process per file: the compiles (CPU-bound, most of the time) run side by side
                timeout 400 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE tests/$t.py -k "gpu or cuda" \
                    > "$OUT/gputests_$t.log" 2>&1 &
            done; wait; tail -n 15 "$OUT"/gputests_*.log ;;
        serve) timeout 450 bash bench/serve_replay.sh ;;
        *) echo "unknown step $step" ;;
    esac > "$log" 2>&1
    echo "exit $? ($(date -u +%H:%M:%S))"
    for rows in agent_replay decode_sweep throughput; do  # the scripts write these names: keep one per step
        [ -f "$OUT/$rows.json" ] && mv "$OUT/$rows.json" "$OUT/${rows}_$step.json"
    done
    grep -v '^{' "$log" | tail -10
done
