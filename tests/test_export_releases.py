"""Every module `kvfuzz export corpus` writes, run per release without kvfuzz: it fails exactly where its finding's case
fails (a file of its own so that its sessions, one vLLM import each, run beside test_export.py's under xdist)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fuzz.export.code import NoTemplate
from fuzz.export.finding import read_finding, version_key
from fuzz.export.reach import reach_of
from fuzz.export.templates import export, export_all
from fuzz.export.walks import PLACED_FROM
from tests.sweep import sampled
from tests.test_export import FINDINGS, _release_tree

# One release per contract the exported view modules tell apart, and the newest: on each, every module `kvfuzz export
# corpus` writes runs in one pytest session without kvfuzz, as a fork's regression suite runs them.
CORPUS_RELEASES = ["0.20.0", "0.21.0", "0.22.0", "0.23.0", "0.24.0", "0.27.0", "0.29.0", "0.32.0", "0.34.0"]
# The sample README's test command runs (tests/sweep.py): the newest release of the shaped views (one reshape) and of
# the placed views.
SAMPLE = ("0.22.0", "0.34.0")
# What the corpus replay (scripts/findings_table.py) saw on each release, per corpus file: where the case fails with
# its own signature the module must fail; where it fails with another (another bug of the same case, perhaps in a
# function this module does not call, or the other half of a rule the module holds vLLM to half of) the module may
# fail, skip or pass; everywhere else it passes or skips.
REPLAY = FINDINGS.parent.parent / "docs" / "findings-replay.json"
ALLOWED = {"fails": {"fail"}, "other": {"fail", "skip", "pass"}}
# Backends whose modules need a package or extension this environment cannot have (torchvision: PyPI's builds break
# beside the CPU torch; vllm_flash_attn's CUDA kernels): their modules skip here, naming the missing module.
CANNOT_IMPORT_HERE = {"TRITON_MSA", "CUTLASS_MSA", "FLASH_ATTN_MLA_SPARSE"}
# Releases where a check is off by design (tests/test_releases.py BY_DESIGN): the replay passes its findings' cases there
# unseen, and a module, which drives the code itself, may fail (NIXL's worker of 0.29 keeps the receive
# post-processing FINDINGS #34 is about, but kvfuzz drives NIXL from 0.30).
CHECK_OFF = {"nixl": ("0.29.0",)}
# A case written on 0.19.1 stores an fp8 cache's quant mode as none, and the replay skips it where a release derives one
# (fuzz/targets/expressible.py); the module derives it from the release itself (get_kv_quant_mode), so it tests the case that
# release builds, which may meet another bug there: as "other".
DERIVED_BY_MODULE = "field kv_quant_mode: "


# The 0.29+ view check is no test that cannot pass: finding 0a7967da01d8's case in the layout vLLM handles (LBNHC, three
# blocks, each split into two kernel blocks) runs beside the corpus and passes on 0.29.0 (manager views), 0.32.0 and
# 0.34.0 (kernel-block views).
RIGHT_VIEWS_ON = ("0.29.0", "0.32.0", "0.34.0")


def views_vllm_places_right(folder: Path) -> str:
    data = json.loads((FINDINGS / "0a7967da01d8-8508129e4b9fb775.json").read_text())
    data["case"].update(layout="LBNHC", num_blocks=3)
    path = folder / "variant.json"
    path.write_text(json.dumps(data))
    found = read_finding(path)
    module = export(found, reach_of(found.case, found.meta, None))
    assert '"kernel_blocks": (2, 2)' in module.source
    (folder / module.file_name).write_text(module.source)
    return module.file_name


@pytest.fixture(scope="module")
def exported_corpus(tmp_path_factory):
    """Every module `kvfuzz export corpus` writes, by file name, with its finding and walk (export_all's `part`); and a
    folder for the control module."""
    folder = tmp_path_factory.mktemp("exported")
    modules = {}
    for path in sorted(FINDINGS.glob("*.json")):
        found = read_finding(path)
        try:
            exported = export_all(found, reach_of(found.case, found.meta, None))
        except NoTemplate:
            continue
        for module in exported:
            (folder / module.file_name).write_text(module.source)
            modules[module.file_name] = (found, module.part)
    return folder, modules, tmp_path_factory.mktemp("control")


def other_walk(part: str, version: str) -> bool:
    """Whether `version` allocates in the other generation than a per-walk module's (such a module skips there)."""
    placed = version_key(version) >= version_key(PLACED_FROM)
    return bool(part) and placed != (part == "from_0_29")


def check_every_module_on(version, exported_corpus):
    """Every exported module fails exactly where its case fails with its own signature on `version` (REPLAY, ALLOWED).
    The releases are split over three files (this one, _shaped and _placed) so that xdist's `--dist loadfile` runs them
    side by side: each is an isolated session importing vLLM afresh."""
    from fuzz.export.isolated import run_isolated_many

    folder, modules, control_folder = exported_corpus
    paths = [folder / name for name in modules]
    control = views_vllm_places_right(control_folder) if version in RIGHT_VIEWS_ON else None
    if control is not None:
        paths.append(control_folder / control)
    replay = json.loads(REPLAY.read_text())["files"]
    outcomes = run_isolated_many(paths, _release_tree(version))
    assert control is None or outcomes.pop(control) == "pass"
    wrong = {}
    for name, (found, part) in modules.items():
        replayed = replay[f"corpus/findings/{found.path.name}"][version]
        status = replayed["status"]
        if status == "skipped" and replayed.get("detail", "").startswith(DERIVED_BY_MODULE):
            status = "other"
        allowed = {"skip"} if other_walk(part, version) else ALLOWED.get(status, {"pass", "skip"})
        if {group.backend for group in found.case.groups} & CANNOT_IMPORT_HERE:
            allowed = allowed | {"skip"}
        if any(version in CHECK_OFF.get(check, ()) for check in (found.case.touches.consumers if found.case.touches else ())):
            allowed = allowed | {"fail"}
        if outcomes[name] not in allowed:
            wrong[name] = f"{outcomes[name]}, but the replay of {found.path.name} on {version}: {status}"
    assert not wrong
    assert "fail" in outcomes.values()  # every release here carries findings: a run where all skip ran nothing


@pytest.mark.slow
@pytest.mark.releases
@pytest.mark.parametrize("version", sampled(CORPUS_RELEASES[:3], SAMPLE))
def test_every_exported_module_fails_exactly_on_the_releases_its_finding_affects(version, exported_corpus):
    check_every_module_on(version, exported_corpus)


@pytest.mark.slow
@pytest.mark.releases
def test_the_cpu_zeroing_modules_pass_on_the_release_that_fixed_them(tmp_path):
    """#17 and #29 are fixed in 0.34 (the CPU runner zeroes through CPUKVBlockZeroer): their modules run that zeroer there
    and pass, where they fail on 0.29 - 0.33."""
    from fuzz.export.isolated import run_isolated_many

    paths = []
    for stem in ("0e0bf1928823-1484f0ae90990517", "0c4c97c48f4c-e88780287632ed2b"):  # #17, #29
        found = read_finding(FINDINGS / f"{stem}.json")
        module = export(found, reach_of(found.case, found.meta, None))
        assert "CPUKVBlockZeroer(" in module.source
        paths.append(tmp_path / module.file_name)
        paths[-1].write_text(module.source)
    outcomes = run_isolated_many(paths, _release_tree("0.34.0"))
    assert set(outcomes.values()) == {"pass"}, outcomes


@pytest.mark.sweep
@pytest.mark.slow
@pytest.mark.releases
def test_the_triton_zeroing_modules_on_the_release_that_fixed_one_and_broke_the_other(tmp_path):
    """0.28 zeroes every attention layer (#21 fixed) and splits a compressed block the views keep whole (#27): on 0.28.0
    #21's modules pass and #27's zero-escape module fails, each running vLLM's Triton kernel (the interpreter here)."""
    from fuzz.export.isolated import run_isolated_many

    want = {"e1619f3c765d-9c7782ebc01380b0": "pass", "7768162ba306-395036546b18d807": "pass",  # #21
            "f056026d23a0-8f606f1e52c53bee": "fail",  # #27
            "4fcbea419a76-f93e86d1c02bfbdd": "fail"}  # #27 past the cache: the stray stores counted, not written
    names = {}
    for stem, outcome in want.items():
        found = read_finding(FINDINGS / f"{stem}.json")
        module = export(found, reach_of(found.case, found.meta, None))
        (tmp_path / module.file_name).write_text(module.source)
        names[module.file_name] = outcome
    outcomes = run_isolated_many([tmp_path / name for name in names], _release_tree("0.28.0"))
    assert outcomes == names
