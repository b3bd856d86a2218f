"""What is printed before training: the run header and the parameter table."""

from __future__ import annotations


def describe_run(cfg, build, data, *, workdir: str, origin: str, peak: float | None,
                 determinism: str | None = None) -> str:
    """The run's header from its pieces: `build` (a jtrain.build.Build: model, params,
    precision, mesh, optimizer split, memory plan, eval spec, FLOPs) and `data` (a
    jtrain.data.RunData: sources and their info)."""
    import jax
    import numpy as np

    info, flops = data.info, build.flops_per_example
    extra = []
    if "fingerprint" in info:
        extra.append(f"jtrain: corpus sha256 {info['fingerprint'][:16]}..., "
                     f"{info['num_bytes']:,} bytes from {info['num_files']} files")
    extra += [f"jtrain: data: {note}" for note in info.get("notes", ())]
    mfu = f"MFU vs peak {peak:.3g} FLOP/s/device" if peak else "MFU n/a (set perf.peak_flops)"
    if determinism:
        extra.append(f"jtrain: {determinism}")
    if build.policy.warning():  # the model's layers compute in their own dtype
        extra.append(build.policy.warning())
    leaves = jax.tree.leaves(build.abstract.params)
    n_params = sum(int(np.prod(x.shape)) for x in leaves)
    extra.append(optimizer_line(cfg.optim, cfg.total_steps, build.grad_accum_steps))
    extra.append(trainable_line(n_params, len(leaves), build.trainable))
    if build.memory_plan is not None:
        extra.append(f"jtrain: {build.memory_plan.describe()}")
    extra.append(f"jtrain: eval {build.eval_spec.task}: {', '.join(build.eval_spec.names)}; "
                 + (f"{flops:.3g} train FLOPs/example, {mfu}" if flops else "MFU n/a"))
    return run_header(
        model=f"{build.model_name} ({build.model_fns.kind})", num_params=n_params,
        precision=build.policy.describe(), mesh_shape=dict(build.mesh.shape),
        data_name=str(info.get("name")), train_size=data.train.known_size,
        eval_size=len(data.eval) if data.eval is not None else 0,
        global_batch=cfg.data.batch_size, workdir=workdir, origin=origin,
        batches_per_epoch=info.get("batches_per_epoch"), extra=tuple(extra))


def run_header(*, model: str, num_params: int, precision: str, mesh_shape: dict,
               data_name: str, train_size: int | None, eval_size: int, global_batch: int,
               workdir: str, origin: str, batches_per_epoch: int | None = None,
               extra: tuple[str, ...] = ()) -> str:
    """The lines printed before training: what, on what, with what data, where, and where
    the weights came from (`origin`: fresh start / resumed from / initialized from).
    `train_size` None: a stream of unknown length (its epoch is learned as it runs)."""
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
        + (f"{per_epoch:,} batches per epoch" if per_epoch else
           "epoch length unknown until the first epoch ends"),
        *extra,
        f"jtrain: workdir {workdir}; {origin}",
    ]
    return "\n".join(lines)


def optimizer_line(optim, total_steps: int, grad_accum_steps: int | None = None) -> str:
    """`jtrain: optimizer adamw, peak lr 3e-03, warmup_cosine schedule (100 warmup steps,
    decay until step 1500), clip_norm 1, weight decay 0.1, 1 microbatch per update`.
    `grad_accum_steps`: what the step uses when the memory plan chose it."""
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


def trainable_line(num_params: int, num_leaves: int, split: dict | None) -> str:
    """Trainable and frozen counts (`split`: optim.trainable_split's, None: all train)."""
    (tl, tn), (fl, fn) = ((split["train"], split["frozen"]) if split
                          else ((num_leaves, num_params), (0, 0)))
    return (f"jtrain: trainable {tn:,} params in {tl} leaves; frozen {fn:,} in {fl} leaves"
            + (" (optim.trainable / optim.frozen)" if fl else ""))


def parameter_table(params, max_lines: int = 60) -> str:
    """Per-module parameter table (clu.parameter_overview; shapes only, no values)."""
    from clu import parameter_overview

    return parameter_overview.get_parameter_overview(params, include_stats=False,
                                                     max_lines=max_lines)
