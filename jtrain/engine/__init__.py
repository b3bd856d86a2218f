"""The engine: a run from its config to its summary, and the library halves of the
commands that read a run.

    run.py              train() and its page, train_and_evaluate() (the train command
                        calls it): resolve once, data, build, restore, loop, summary
    assemble.py         build(): one page, top-down over parts.py's helpers; check_run
    parts.py            Build and build's helpers: model, LoRA, loss, optimizer, state,
                        population, train metrics, memory plan, the jitted steps
    checks.py           pre-flight: the model takes each split's inputs, the loss scores
                        them, targets fit the outputs
    loop.py             the loop: dispatch, drain, eval before save, decide, save
    evaluation.py       the eval pass shared by training and jtrain evaluate
    summary.py          the end of a run: summary.json, the final line, a halt's record
    own_step.py         a step of your own (jtrain.step.Step): build's sibling, its checks
    population.py       population.size > 1: the member axis, vmapped init and step,
                        each member evaluated, the summary's block and plot
    checkpoint_eval.py  evaluate_checkpoint(): a saved step scored, its report written
    async_eval.py       eval.mode=async: the evaluator following a workdir, the loop's
                        held points and the evals it applies at a fixed lag
    diff.py             diff_runs(): where two runs part
    replay.py           replay(): a recorded step re-run, its state hash compared
    sample.py           sample(): a language model's continuations of prompts (KV cache)
    lm_tasks.py         eval.lm_tasks: choice accuracy, held-out perplexity as eval metrics
    lm_eval.py          JtrainLM: a run as an lm-eval model (the `lmeval` extra)
    dry_run.py          --dry_run: the steps compiled for a topology, memory reported
"""
