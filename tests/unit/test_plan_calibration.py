"""The planner against the published runs it is calibrated on: each run's published throughput
falls inside the planner's range for it (the cluster file's efficiency range for the run's
mode), and compile is priced only where torch can compile."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.plan import Hardware
from lightning_zeropp.plan.hardware import compile_mode
from lightning_zeropp.plan.published import PUBLISHED, PublishedRun, predict

CLUSTERS = Path(__file__).resolve().parents[2] / "conf" / "cluster"


def _h100() -> Hardware:
    return Hardware.from_cluster(yaml.safe_load((CLUSTERS / "h100_4x8.yaml").read_text()), "bf16")


@pytest.mark.parametrize("run", [r for r in PUBLISHED if r.calibrates], ids=lambda r: r.name)
def test_the_planners_range_contains_each_published_run(run: PublishedRun) -> None:
    hw = _h100()
    assert hw.efficiency is not None
    low, high = hw.efficiency["compiled" if run.compiled else "eager"]
    slow, fast = predict(run, hw, low), predict(run, hw, high)
    assert slow <= run.value <= fast, (run.name, slow, run.value, fast)


def test_every_h100_cluster_file_gives_the_same_calibrated_ranges() -> None:
    ranges = {
        name: Hardware.from_cluster(
            yaml.safe_load((CLUSTERS / f"{name}.yaml").read_text())
        ).efficiency
        for name in ("h100_1x8", "h100_4x8", "h100_16x8")
    }
    assert len({str(r) for r in ranges.values()}) == 1
    (eager, compiled) = ranges["h100_4x8"]["eager"], ranges["h100_4x8"]["compiled"]
    assert eager[0] < compiled[0] and eager[1] < compiled[1]  # compiling is worth something


def test_split_backward_compiles_in_regions_priced_between_eager_and_compiled() -> None:
    # torch refuses compiled stages under split backward; the library compiles there only the
    # regions between the weights (the matmuls stay eager): priced from eager's low end to
    # compiled's high end, as no published run measures it
    hw = _h100()
    split = ZeroPPConfig(pp_size=2, schedule="zbv", num_microbatches=4).resolve(2)
    plain = ZeroPPConfig(pp_size=2, schedule="1f1b", num_microbatches=4).resolve(2)
    zeropp = ZeroPPConfig(pp_size=2, schedule="zeropp", num_microbatches=4).resolve(2)
    whole = ZeroPPConfig(pp_size=2, schedule="zeropp", num_microbatches=4, split_backward=False)
    assert compile_mode(split, True) == compile_mode(zeropp, True) == "regions"
    assert compile_mode(plain, True) == compile_mode(whole.resolve(2), True) == "compiled"
    assert compile_mode(plain, False) == compile_mode(split, False) == "eager"
    assert compile_mode(ZeroPPConfig(pp_size=2, compile=True).resolve(2)) == "compiled"
    assert hw.efficiency["regions"] == (hw.efficiency["eager"][0], hw.efficiency["compiled"][1])
    eager, regions, compiled = (hw.at(m).flops_per_s for m in ("eager", "regions", "compiled"))
    assert eager < regions < compiled
    assert eager == pytest.approx(989e12 * sum(hw.efficiency["eager"]) / 2)
    # without a range (a measured rate) the mode changes nothing
    measured = Hardware(flops_per_s=1e12, intra_node_Bps=1e9, inter_node_Bps=1e9, node_size=8)
    assert measured.at("compiled", "low").flops_per_s == measured.at("eager", "high").flops_per_s


def test_a_cluster_file_with_a_bad_efficiency_is_refused() -> None:
    cluster = yaml.safe_load((CLUSTERS / "h100_4x8.yaml").read_text())
    cluster["planner"]["efficiency"] = {"eager": [0.4, 1.5]}
    with pytest.raises(ValueError, match=r"planner.efficiency.eager=\[0.4, 1.5\]"):
        Hardware.from_cluster(cluster)
