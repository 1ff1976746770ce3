"""The sectioned configuration: the parser is built from the fields, and validation from their
rules (unit tests: no MPI)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gem_mpi import config
from gem_mpi.errors import UsageError
from gem_mpi.run.preflight import validate

# the flat option names every metrics file and checkpoint records (their "config")
RECORDED = {
    "method", "model", "dataset", "data_dir", "lr", "momentum", "kappa", "pi_max", "eps",
    "batch_size", "epochs", "max_steps", "shard", "seed", "eval_every", "eval_batch_size",
    "metrics", "save", "synthetic_size", "quadratic_dim", "threads", "poll_max_ms",
    "log_every", "verbose", "no_extension", "straggler", "stop_on_divergence",
    "divergence_factor", "checkpoint_dir", "checkpoint_every", "resume", "run_id", "min_free_mb",
    "worker_timeout", "gem_shift", "exit_timeout", "loss", "worker_mode", "gradient_at", "gem_proxy",
    "holdout", "masters", "lr_schedule", "warmup_steps", "lr_decay_steps", "lr_step_every",
    "lr_gamma", "lr_min", "clip_grad_norm", "amp", "bn_batches",
    "loader_workers", "wire", "ga_decay", "ga_eps", "diloco_steps", "diloco_outer_lr",
    "diloco_outer_momentum", "group_size", "worker_loss", "optimizer", "betas", "adam_eps",
    "weight_decay", "speeds", "context", "test_bytes", "gpt_layers", "gpt_heads", "gpt_width",
    "flops", "local_steps", "dylu", "dn_outer_lr", "dn_momentum", "dn_every", "tensorboard", "wandb",
    "keep_checkpoints", "interface", "profile_steps", "profile_dir", "worker_nice",
}


def test_every_option_is_in_exactly_one_section_and_recorded_flat():
    cfg, _ = config.parse([])
    assert set(cfg.as_dict()) == RECORDED
    names = [f.name for s in config.SECTIONS.values() for f in dataclasses.fields(s)]
    assert len(names) == len(set(names))
    assert config.Config.of(**cfg.as_dict()) == cfg


def test_the_parser_follows_the_fields():
    cfg, _ = config.parse(["--lr", "0.1", "--no-stop-on-divergence", "--shard", "--metrics",
                           "m.h5", "--straggler", "2:5", "--threads", "3"])
    assert cfg.optim.lr == 0.1 and cfg.monitor.stop_on_divergence is False
    assert cfg.data.shard is True and cfg.outputs.metrics == "m.h5"
    assert cfg.runtime.straggler == "2:5" and cfg.runtime.threads == 3
    _, help_text = config.parse(["--help"])
    for section in config.SECTIONS:
        assert f"{section}:" in help_text
    with pytest.raises(UsageError, match="unrecognized arguments"):
        config.parse(["--no-such-option"])


@pytest.mark.parametrize("option, value", [("--eps", "1e-50"), ("--pi-max", "1e-50"),
                                           ("--pi-max", "1e40"), ("--lr", "nan"),
                                           ("--momentum", "1"), ("--divergence-factor", "1")])
def test_values_that_cannot_work_are_one_line(option, value):
    cfg, _ = config.parse([option, value])
    with pytest.raises(UsageError, match=f"^{option} must be .*got"):
        validate(cfg, 5)


def test_eps_and_pi_max_are_checked_in_the_kernels_float32():
    """1e-50 is positive in float64 but 0 in float32: the kernel would divide by it."""
    cfg, _ = config.parse(["--eps", "1e-30"])
    validate(cfg, 5)  # representable in float32: fine
    cfg, _ = config.parse(["--eps", "1e-50"])
    with pytest.raises(UsageError, match="finite in float32"):
        validate(cfg, 5)


def test_worker_modes_are_named_and_only_for_the_asynchronous_methods():
    cfg, _ = config.parse(["--worker-mode", "eager"])
    with pytest.raises(UsageError, match="^--worker-mode must be one of wait, pipelined, overlap"):
        validate(cfg, 5, data=False)
    cfg, _ = config.parse(["--method", "sync", "--worker-mode", "pipelined"])
    with pytest.raises(UsageError, match="--worker-mode is for the asynchronous methods"):
        validate(cfg, 5, data=False)
    cfg, _ = config.parse(["--worker-mode", "pipelined"])
    validate(cfg, 5, data=False)


def test_the_global_proxy_is_gems_and_its_decay_must_decay():
    cfg, _ = config.parse(["--gem-proxy", "both"])
    with pytest.raises(UsageError, match="^--gem-proxy must be one of local, global"):
        validate(cfg, 5, data=False)
    for method in ("downpour", "adaptive", "sync"):
        cfg, _ = config.parse(["--method", method, "--gem-proxy", "global"])
        with pytest.raises(UsageError, match=f"is GEM's: --method {method} does not use it"):
            validate(cfg, 5, data=False)
    for extra in ([], ["--gem-shift", "paper"], ["--worker-mode", "pipelined"]):
        cfg, _ = config.parse(["--gem-proxy", "global", *extra])
        validate(cfg, 5, data=False)
    # μ^(1/n) that rounds to 1 in float32 would never decay
    cfg, _ = config.parse(["--gem-proxy", "global", "--momentum", "0.99999994"])
    validate(cfg, 2, data=False)  # one worker: μ itself
    with pytest.raises(UsageError, match="never decays"):
        validate(cfg, 6, data=False)


def test_a_checkpoint_older_than_an_option_ran_with_its_default():
    """A checkpoint's config lacks options added after it was written: it ran with their
    defaults, so a resume with the default is the same setting and another value is not."""
    from gem_mpi.outputs import checkpoint

    old, _ = config.parse([])
    recorded = {k: v for k, v in old.as_dict().items()
                if k not in ("gem_proxy", "worker_mode", "gradient_at", "lr_schedule", "amp")}
    state = checkpoint.Checkpoint(theta=np.zeros(1, np.float32), clock=0, run_id="r",
                                  elapsed_s=0.0, config=recorded, n_workers=4, path="c.h5")
    checkpoint.check_compatible(state, old.as_dict(), 4)
    assert checkpoint.changes(state, old.as_dict()) == {}
    new, _ = config.parse(["--gem-proxy", "global"])
    with pytest.raises(UsageError, match="--gem-proxy was 'local', now 'global'"):
        checkpoint.check_compatible(state, new.as_dict(), 4)
    new, _ = config.parse(["--lr-schedule", "cosine"])
    with pytest.raises(UsageError, match="--lr-schedule was 'constant', now 'cosine'"):
        checkpoint.check_compatible(state, new.as_dict(), 4)


def _every_option_changed() -> config.Config:
    """A config whose every option differs from its default (types kept, validity not)."""
    changed = {}
    for section in config.SECTIONS.values():
        for f in dataclasses.fields(section):
            d = f.default
            if isinstance(d, bool):
                changed[f.name] = not d
            elif isinstance(d, int):
                changed[f.name] = d + 3
            elif isinstance(d, float):
                changed[f.name] = d * 1.5 + 0.125
            else:  # a string, or None (an unset path or name)
                changed[f.name] = (d or "") + "x"
    return config.Config.of(**changed)


def test_print_config_writes_a_file_that_config_reads_back_to_the_same_run(tmp_path):
    cfg = _every_option_changed()
    argv = []
    for name, section in config.SECTIONS.items():
        for f in dataclasses.fields(section):
            value = getattr(getattr(cfg, name), f.name)
            if isinstance(value, bool):  # a switch: its flag alone turns it
                argv += [config.flag_of(f)] if value != f.default else []
            else:
                argv += [config.flag_of(f), str(value)]
    assert config.parse(argv) == (cfg, None)  # the flags say cfg...
    _, text = config.parse([*argv, "--print-config"])
    run = tmp_path / "run.toml"
    run.write_text(text)
    assert config.parse(["--config", str(run)]) == (cfg, None)  # ...and so does the file
    # sections are tables of the file, every option under its own
    for name, section in config.SECTIONS.items():
        assert f"[{name}]" in text
    # the command line overrides the file, a switch included
    over, _ = config.parse(["--config", str(run), "--lr", "0.25"])
    assert over.optim.lr == 0.25 and over.data == cfg.data
    dashed = tmp_path / "dashed.toml"
    dashed.write_text('[optim]\nclip-grad-norm = 2\n[data]\nshard = true\n')
    cfg, _ = config.parse(["--config", str(dashed)])
    assert cfg.optim.clip_grad_norm == 2.0 and isinstance(cfg.optim.clip_grad_norm, float)
    assert cfg.data.shard is True


@pytest.mark.parametrize(("text", "message"), [
    ("[optim]\nlr = 'fast'\n", "optim.lr must be a number, got 'fast'"),
    ("[optim]\nlr = true\n", "optim.lr must be a number, got True"),
    ("[data]\nbatch_size = 6.5\n", "data.batch_size must be an integer, got 6.5"),
    ("[data]\nshard = 1\n", "data.shard must be true or false, got 1"),
    ("[optim]\nlearning_rate = 0.1\n", "unknown key optim.learning_rate"),
    ("[data]\nlr = 0.1\n", "unknown key data.lr"),  # an option of another section
    ("[training]\nlr = 0.1\n", "unknown section [training]"),
    ("lr = 0.1\n", "unknown section [lr]"),
    ("[optim\n", "not valid TOML"),
])
def test_a_config_file_s_mistake_is_one_line_naming_the_key_and_the_file(tmp_path, text,
                                                                         message):
    run = tmp_path / "run.toml"
    run.write_text(text)
    with pytest.raises(UsageError) as refused:
        config.parse(["--config", str(run)])
    line = str(refused.value)
    assert message in line and str(run) in line and "\n" not in line, line
    with pytest.raises(UsageError, match="No such file"):
        config.parse(["--config", str(tmp_path / "none.toml")])
