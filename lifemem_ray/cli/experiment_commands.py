"""``lifemem-ray run``: the lifelong experiment on a local or given Ray cluster."""

from __future__ import annotations

import argparse
import logging
import os

from lifemem_ray.cli.options import config_from_args, emit, set_overrides


def cmd_run(args: argparse.Namespace) -> int:
    """The lifelong experiment: rollout workers on Ray against a memory per mode."""
    import ray

    from lifemem_ray.actors.cluster.ray_address import join, named_address, private_ray
    from lifemem_ray.actors.rollout.experiment import run_experiment
    from lifemem_ray.actors.rollout.workers import print_progress
    from lifemem_ray.lab.experiment_config import ExperimentConfig

    config = config_from_args(args)
    overrides = {k.split(".", 1)[1]: v for k, v in set_overrides(args).items() if k.startswith("experiment.")}
    for flag in ("workers", "seeds", "stream", "agent", "output"):
        value = getattr(args, flag, None)
        if value is not None:
            overrides[flag] = value
    if args.envs:
        overrides["envs"] = args.envs
    if args.modes:
        overrides["modes"] = args.modes
    if args.eval_envs is not None:
        overrides["eval_envs"] = args.eval_envs
    if config.llm.backend == "openai" and "agent" not in overrides:
        overrides["agent"] = "react"  # an endpoint is configured: the LLM agent acts
    exp = ExperimentConfig.load(args.config, overrides=overrides)
    # --address or RAY_ADDRESS, joined within seconds or not at all; else a Ray of its own for the run
    # (never one found by searching, and not the head `serve` started: the run brings its own memories).
    target = named_address(args.address, own_head_counts=False)
    if target.address is not None:
        join(target, log_to_driver=args.verbose, logging_level=logging.WARNING)
    else:
        # Logical CPUs leave room for the workers beside the memory's actors.
        cpus = max(4, (os.cpu_count() or 2) + exp.workers)
        private_ray(num_cpus=cpus, include_dashboard=False, log_to_driver=args.verbose, logging_level=logging.WARNING)
    try:
        report = run_experiment(exp, config, progress=None if args.quiet else print_progress)
    finally:
        ray.shutdown()
    out = exp.output_dir

    def text() -> str:
        md = (out / "report.md").read_text()
        tp = report["throughput"]
        return (
            md
            + f"\n{tp['episodes']} episodes, {tp['steps_per_s']:.0f} steps/s, memory p50 {tp['memory_p50_ms']:.1f} ms, "
            f"{report['seconds']:.0f} s in all.\nReport: {out / 'report.md'}, {out / 'report.json'}; plots: "
            + ", ".join(report["plots"])
        )

    emit(args, report, text)
    return 0
