"""What is printed before training: the run header and the parameter table."""

from __future__ import annotations

import math


def describe_run(cfg, build, data, *, workdir: str, origin: str, peak: float | None,
                 determinism: str | None = None) -> str:
    """The run's header from its pieces: `build` (a jtrain.engine.assemble.Build: model, params,
    precision, mesh, optimizer split, memory plan, eval spec, FLOPs) and `data` (a
    jtrain.data.RunData: sources and their info)."""
    import jax
    import numpy as np

    info, flops = data.info, build.flops_per_example
    extra = []
    if "num_tokens" in info:  # data.name=tokens
        extra.append(f"jtrain: token shards sha256 {info['fingerprint'][:16]}..., "
                     f"{info['num_tokens']:,} tokens, tokenizer {info['tokenizer']['kind']} "
                     f"(vocab {info['vocab_size']:,})")
    elif "fingerprint" in info:
        extra.append(f"jtrain: corpus sha256 {info['fingerprint'][:16]}..., "
                     f"{info['num_bytes']:,} bytes from {info['num_files']} files")
    extra += [f"jtrain: data: {note}" for note in info.get("notes", ())]
    extra += [f"jtrain: warning: {line}" for line in info.get("warnings", ())]
    mfu = f"MFU vs peak {peak:.3g} FLOP/s/device" if peak else "MFU n/a (set perf.peak_flops)"
    if determinism:
        extra.append(f"jtrain: {determinism}")
    if build.policy.warning():  # the model's layers compute in their own dtype
        extra.append(build.policy.warning())
    leaves = jax.tree.leaves(build.abstract.params)
    n_params = sum(int(np.prod(x.shape)) for x in leaves)
    own = getattr(build, "user_step", None) is not None
    if own:  # its optimizers are its own: optim.* configures the built-in update
        extra.append(f"jtrain: {build.model_name}: init / update / evaluate of your own; its "
                     f"state: {n_params:,} values in {len(leaves)} leaves (params and "
                     "optimizer states alike)")
    elif getattr(build, "tx_given", False):
        extra.append(f"jtrain: optimizer: the optax transformation given to "
                     f"jtrain.train(tx=...) (its own learning rate and schedule), "
                     f"{build.grad_accum_steps} microbatch(es) per update")
    else:
        extra.append(optimizer_line(cfg.optim, cfg.total_steps, build.grad_accum_steps,
                                    params=build.abstract.params))
        extra.append(trainable_line(n_params, len(leaves), build.trainable))
    extra += sharding_lines(cfg.mesh, build.mesh, build.abstract, build.shardings)
    if cfg.mesh.stage > 1:
        from jtrain.mesh import pipeline_line

        extra.append(pipeline_line(cfg.mesh.stage, cfg.mesh.microbatches,
                                   cfg.model.num_layers))
    if build.abstract.ema is not None:
        extra.append(ema_line(cfg.optim.ema, cfg.eval.weights, build.abstract.ema,
                              build.shardings.ema))
    if build.memory_plan is not None:
        extra.append(f"jtrain: {build.memory_plan.describe()}")
    if getattr(build, "population", None) is not None:  # K members, one compiled step
        extra.append(build.population.describe())
    if build.eval_spec is not None:
        extra.append(f"jtrain: eval {build.eval_spec.task}: "
                     f"{', '.join(build.eval_spec.names)}; "
                     + (f"{flops:.3g} train FLOPs/example, {mfu}" if flops else "MFU n/a"))
    return run_header(
        model=build.model_name if own else f"{build.model_name} ({build.model_fns.kind})",
        num_params=n_params,
        precision=build.policy.describe(), mesh_shape=dict(build.mesh.shape),
        data_name=str(info.get("name")), train_size=data.train.known_size,
        eval_size=len(data.eval) if data.eval is not None else 0,
        global_batch=cfg.data.batch_size, workdir=workdir, origin=origin,
        batches_per_epoch=info.get("batches_per_epoch"), components=info.get("components"),
        extra=tuple(extra))


def run_header(*, model: str, num_params: int, precision: str, mesh_shape: dict,
               data_name: str, train_size: int | None, eval_size: int, global_batch: int,
               workdir: str, origin: str, batches_per_epoch: int | None = None,
               components: str | None = None, extra: tuple[str, ...] = ()) -> str:
    """The lines printed before training: what, on what, with what data, where, and where
    the weights came from (`origin`: fresh start / resumed from / initialized from).
    `train_size` None: a stream of unknown length (its epoch is learned as it runs).
    `components`: a mixture's components, said instead of batches per epoch (each
    component runs through its own epochs)."""
    import jax

    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices} - {jax.default_backend()})
    shape = " x ".join(f"{k}={v}" for k, v in mesh_shape.items())
    if train_size is None:
        size = "a stream of unknown length"
        per_epoch = batches_per_epoch
    else:
        size = f"{train_size:,}"
        per_epoch = (batches_per_epoch if batches_per_epoch is not None
                     else train_size // global_batch)
    lines = [
        f"jtrain: model {model}, {num_params:,} params, {precision}",
        f"jtrain: {len(devices)} {jax.default_backend()} device(s)"
        + (f" ({', '.join(kinds)})" if kinds else "") + ", "
        f"{jax.process_count()} process(es), mesh {shape}",
        f"jtrain: data {data_name}: {size} train / {eval_size:,} eval examples, "
        f"global batch {global_batch}, "
        + (components if components else f"{per_epoch:,} batches per epoch" if per_epoch
           else "epoch length unknown until the first epoch ends"),
        *extra,
        f"jtrain: workdir {workdir}; {origin}",
    ]
    return "\n".join(lines)


def optimizer_line(optim, total_steps: int, grad_accum_steps: int | None = None, *,
                   params=None) -> str:
    """`jtrain: optimizer adamw, peak lr 3e-03, warmup_cosine schedule (100 warmup steps,
    decay until step 1500), clip_norm 1, weight decay 0.1, 1 microbatch per update`.
    `grad_accum_steps`: what the step uses when the memory plan chose it. `params`
    (abstract): muon's split into 2-D leaves and its adam fallback is counted."""
    return _optimizer_line(optim, total_steps, grad_accum_steps) + _optimizer_notes(
        optim, params)


def _optimizer_notes(optim, params) -> str:
    import jax

    from jtrain import optim as optim_lib

    if optim.name in optim_lib.SCHEDULE_FREE:
        return ("; schedule-free: evaluation uses its averaged params "
                "(schedule_free_eval_params), and its export writes them")
    if optim.name != "muon" or params is None:
        return ""
    labels = optim_lib.trainable_labels(params, optim.trainable, optim.frozen)
    counts = {"muon": [0, 0], "adam": [0, 0]}
    for kind, label, leaf in zip(jax.tree.leaves(optim_lib.muon_labels(params)),
                                 jax.tree.leaves(labels), jax.tree.leaves(params), strict=True):
        if label == "train":
            counts[kind][0] += 1
            counts[kind][1] += int(math.prod(leaf.shape))
    (ml, mn), (al, an) = counts["muon"], counts["adam"]
    return (f"; muon on {ml} 2-D leaves ({mn:,} params), its adam fallback on {al} "
            f"other leaves ({an:,} params)")


def _optimizer_line(optim, total_steps: int, grad_accum_steps: int | None) -> str:
    decay_end = optim.decay_steps or total_steps
    schedule = (f"{optim.schedule} schedule ({optim.warmup_steps} warmup steps"
                + ("" if optim.schedule == "constant" else
                   f", decay until step {decay_end} to lr x {optim.end_lr_factor:g}") + ")")
    return (f"jtrain: optimizer {optim.name}, peak lr {optim.lr:.3g}, {schedule}, "
            + (f"clip_norm {optim.clip_norm:g}" if optim.clip_norm else "no clipping")
            + (f", weight decay {optim.weight_decay:g}" if optim.weight_decay else "")
            + (f", {optim.grad_accum_steps} microbatch(es) per update (optim.grad_accum_steps)"
               if grad_accum_steps in (None, optim.grad_accum_steps) else
               f", {grad_accum_steps} microbatch(es) per update (the memory plan; "
               f"optim.grad_accum_steps={optim.grad_accum_steps})"))


def sharding_lines(mesh_cfg, mesh, abstract, shardings) -> list[str]:
    """`jtrain: sharding: params 1,234 of 9,872 bytes per device (20 leaves sharded, 3
    replicated, 2 replicated (annotated), 7 too small (< 4,096 bytes,
    mesh.auto_shard_min_bytes)); optimizer state 2,468 of 19,744 bytes per device`
    ("replicated (annotated)": leaves the model annotated as replicated, any size; left
    out when none), and a warning for each parameter axis of size > 1 that shards
    nothing."""
    from jtrain import mesh as mesh_lib

    min_bytes = mesh_lib.auto_shard_bytes(mesh_cfg) if mesh.shape["fsdp"] > 1 else None
    p = mesh_lib.layout(abstract.params, shardings.params, min_bytes)
    o = mesh_lib.layout(abstract.opt_state, shardings.opt_state)
    small = (f", {p['annotated']} replicated (annotated)" if p["annotated"] else "") + (
        f", {p['small']} too small (< {min_bytes:,} bytes, mesh.auto_shard_min_bytes)"
        if min_bytes else "")
    auto = ("" if mesh.shape["fsdp"] == 1 else "; mesh.auto_shard on" if min_bytes is not None
            else "; mesh.auto_shard off")
    lines = [f"jtrain: sharding: params {p['per_device_bytes']:,} of {p['total_bytes']:,} "
             f"bytes per device ({p['sharded']} leaves sharded, {p['replicated']} "
             f"replicated{small}){auto}; optimizer state {o['per_device_bytes']:,} of "
             f"{o['total_bytes']:,} bytes per device"]
    for axis in mesh_lib.idle_axes(shardings.params, mesh):
        hint = ("only weights with the logical axis 'expert' (model.moe's experts) split "
                "over it; the batch is split over it as over mesh.data" if axis == "expert"
                else "annotate parameters (nnx.with_partitioning / nn.with_logical_partitioning)"
                + (" or set mesh.auto_shard=True" if axis == "fsdp" else "")
                if axis == "tensor" or min_bytes is None else
                "no unannotated leaf at or above mesh.auto_shard_min_bytes has a dimension "
                "it divides")
        lines.append(f"jtrain: warning: mesh.{axis}={mesh.shape[axis]} shards no parameter: "
                     f"its devices hold copies; {hint}")
    return lines


def ema_line(ema_cfg, weights: str, abstract_ema, shardings) -> str:
    """`jtrain: weight EMA on: decay 0.999 (warmup none), 1,234,567 bytes per device;
    eval.weights=both`."""
    from jtrain import state as state_lib

    per_device = state_lib.ema_bytes_per_device(abstract_ema, shardings)
    return (f"jtrain: weight EMA on: decay {ema_cfg.decay:g} (warmup {ema_cfg.warmup}), "
            f"{per_device:,} bytes per device; eval.weights={weights}")


def trainable_line(num_params: int, num_leaves: int, split: dict | None) -> str:
    """Trainable and frozen counts (`split`: optim.trainable_split's, None: all train)."""
    (tl, tn), (fl, fn) = ((split["train"], split["frozen"]) if split
                          else ((num_leaves, num_params), (0, 0)))
    return (f"jtrain: trainable {tn:,} params in {tl} leaves; frozen {fn:,} in {fl} leaves"
            + (" (optim.trainable / optim.frozen)" if fl else ""))


def parameter_table(params, max_lines: int = 60) -> str:
    """Per-module parameter table (clu.parameter_overview; shapes only, no values)."""
    import jax
    from clu import parameter_overview

    # One plain dict by path: a step of your own keeps optax states (named tuples) too.
    flat = {jax.tree_util.keystr(p, simple=True, separator="/"): leaf
            for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    return parameter_overview.get_parameter_overview(flat, include_stats=False,
                                                     max_lines=max_lines)
