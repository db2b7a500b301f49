"""Run by tests/test_fsdp_turbo_standin.py in a subprocess (it imports torch): the STAND-IN's
matching, patching and loading rules on a small model, printed as JSON for the test to compare
with the library's rules (FACTS-fsdp_turbo.md, "Matching rules and what the library refuses")."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fsdp_turbo_standin_core as core  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.proj(x)


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(2, 2)


def doubled(self, x):
    return 2 * self.proj(x)


def outcome(call):
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - the refusal is what is reported
        return f"{type(exc).__name__}: {exc}"


def names(model, patterns):
    found = core._matching(model, patterns, "test")
    by_id = {id(m): n for n, m in model.named_modules()}
    return [by_id[id(m)] for m in found]


def main() -> None:
    model = Tiny()
    here = __name__ if __name__ != "__main__" else "contract_probe"
    sys.modules.setdefault("contract_probe", sys.modules[__name__])
    report = {
        "one_pattern_matching_is_enough": names(model, ["layers.{*}", "not.there"]),
        "none_matching_raises": outcome(lambda: names(model, ["not.there"])),
        "star_is_any_text": names(model, ["layers.*"]),
        "range": names(model, ["layers.{1-1}"]),
        "class_absent": outcome(
            lambda: core._apply_module_patch(
                model, {"target": "torch.nn.Conv1d.forward", "replacement": f"{here}.doubled"}
            )
        ),
        "member_absent": outcome(
            lambda: core._apply_module_patch(
                model, {"target": f"{here}.Block.nowhere", "replacement": f"{here}.doubled"}
            )
        ),
        "class_present": core._apply_module_patch(
            model, {"target": f"{here}.Block.forward", "replacement": f"{here}.doubled"}
        ),
    }
    x = torch.ones(1, 2)
    report["instances_patched"] = bool(torch.equal(model.layers[0](x), 2 * model.layers[0].proj(x)))
    report["class_untouched"] = Block.forward is not doubled and "forward" not in vars(Block())
    report["colon_refused"] = outcome(
        lambda: core.FSDPTurboConfigBase(
            distributed=core.DistributedConfigBase(),
            module_patches=[{"target": "a.b", "replacement": "pkg:fn"}],
        )
    )
    loaded = core._dict_to_dataclass(
        core.FSDPPlanConfig, {"cpu_offload": "true", "num_to_forward_prefetch": "2"}
    )
    report["coerced"] = [loaded.cpu_offload, loaded.num_to_forward_prefetch]
    kept = core._dict_to_dataclass(core.FSDPPlanConfig, {"num_to_backward_prefetch": "two"})
    report["not_a_number_kept"] = kept.num_to_backward_prefetch
    print(json.dumps(report))


if __name__ == "__main__":
    main()
