"""The method records: one per --method, and what the rest of the package derives from them."""

import itertools

import pytest

from gem_mpi import config, methods
from gem_mpi.config import Config, OptimConfig
from gem_mpi.errors import UsageError
from gem_mpi.methods import AMPLITUDE, DELTA, METHODS, SHIFT_BASE
from gem_mpi.protocol import update_payload
from gem_mpi.run.preflight import validate


def test_every_method_name_has_one_record_and_its_engine_kind():
    assert tuple(METHODS) == config.METHODS
    for m in METHODS.values():
        assert m.synchronous == (m.rule is None) == (m.face is not None)
        assert m.threads in ("funneled", "multiple")


def test_an_unknown_method_is_one_line():
    with pytest.raises(UsageError, match="^unknown --method 'sgd'; choose from gem, downpour"):
        methods.of("sgd")


OWNED = [(owner, name) for owner in METHODS.values() for name in owner.options]


def test_the_method_sections_belong_to_their_methods_alone():
    """A section named by a record holds only that method's options, and no option has two
    owners."""
    names = [name for _, name in OWNED]
    assert len(names) == len(set(names))
    assert {"ga_decay", "ga_eps", "diloco_steps", "diloco_outer_lr", "diloco_outer_momentum",
            "gem_proxy", "dn_outer_lr", "dn_momentum", "dn_every"} == set(names)


@pytest.mark.parametrize("owner, name", OWNED, ids=[n for _, n in OWNED])
def test_an_option_of_another_method_is_refused_naming_its_owner(owner, name):
    value = {"gem_proxy": "global", "diloco_steps": 5, "dn_every": 3}.get(name, 0.5)
    for other in METHODS.values():
        cfg = Config.of(method=other.name, **{name: value})
        if other is owner:
            methods.check_own_options(cfg)  # its own: accepted
            continue
        flag = "--" + name.replace("_", "-")
        with pytest.raises(UsageError, match=(f"^{flag} {value} is {owner.title}'s: --method "
                                              f"{other.name} does not use it")):
            validate(cfg, 5, data=False)


@pytest.mark.parametrize("method, shift, proxy, parts, kept", [
    ("gem", "others", "local", (DELTA, AMPLITUDE, SHIFT_BASE), None),
    ("gem", "paper", "local", (DELTA, AMPLITUDE, SHIFT_BASE), SHIFT_BASE),
    ("gem", "others", "global", (DELTA, SHIFT_BASE), None),
    ("gem", "paper", "global", (DELTA, SHIFT_BASE), SHIFT_BASE),
    ("gap-aware", "others", "local", (DELTA, SHIFT_BASE), None),
    ("downpour", "paper", "local", (DELTA,), None),
    ("adaptive", "others", "local", (DELTA,), None),
])
def test_the_payload_is_the_records(method, shift, proxy, parts, kept):
    optim = OptimConfig(method=method, gem_shift=shift, gem_proxy=proxy)
    assert methods.of(method).payload(optim) == (parts, kept)
    payload = update_payload(optim, 7)
    assert (payload.parts, payload.kept) == (parts, kept)


def test_master_state_and_fixed_scales():
    states = {(m, p): methods.of(m).master_state(OptimConfig(method=m, gem_proxy=p))
              for m, p in itertools.product(("gem", "gap-aware", "downpour"), ("local",
                                                                               "global"))}
    assert states[("gem", "global")] == "the global proxy's m"
    assert states[("gap-aware", "local")] == "Gap-Aware's step average v"
    assert states[("gem", "local")] is None and states[("downpour", "local")] is None
    assert methods.of("adaptive").fixed_scale(3) == 0.25
    assert methods.of("downpour").fixed_scale(3) == 1.0


def test_a_resume_holds_every_methods_own_options_to_the_checkpoint():
    from gem_mpi.outputs.checkpoint import MUST_MATCH

    assert {name for _, name in OWNED} <= set(MUST_MATCH)
