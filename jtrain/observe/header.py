"""What is printed before training: the run header and the parameter table."""

from __future__ import annotations

def run_header(*, model: str, num_params: int, precision: str, mesh_shape: dict,
               data_name: str, train_size: int, eval_size: int, global_batch: int,
               workdir: str, resumed_from: int | None, batches_per_epoch: int | None = None,
               extra: tuple[str, ...] = ()) -> str:
    """The lines printed before training: what, on what, with what data, where."""
    import jax

    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices} - {jax.default_backend()})
    shape = " x ".join(f"{k}={v}" for k, v in mesh_shape.items())
    per_epoch = (batches_per_epoch if batches_per_epoch is not None
                 else train_size // global_batch)
    lines = [
        f"jtrain: model {model}, {num_params:,} params, {precision}",
        f"jtrain: {len(devices)} {jax.default_backend()} device(s)"
        + (f" ({', '.join(kinds)})" if kinds else "") + ", "
        f"{jax.process_count()} process(es), mesh {shape}",
        f"jtrain: data {data_name}: {train_size:,} train / {eval_size:,} eval examples, "
        f"global batch {global_batch}, "
        + (f"{per_epoch:,} batches per epoch" if per_epoch else "epoch length unknown"),
        *extra,
        f"jtrain: workdir {workdir}; " + (f"resumed from step {resumed_from}"
                                         if resumed_from is not None else "fresh start"),
    ]
    return "\n".join(lines)


def parameter_table(params, max_lines: int = 60) -> str:
    """Per-module parameter table (clu.parameter_overview; shapes only, no values)."""
    from clu import parameter_overview

    return parameter_overview.get_parameter_overview(params, include_stats=False,
                                                     max_lines=max_lines)
