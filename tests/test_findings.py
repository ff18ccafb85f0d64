"""One finding per bug: the signature names what vLLM did wrong (kind, function, error and message
without numbers); the spec kinds, backends and layouts it shows under are its variants."""

import json
from types import SimpleNamespace

from fuzz.campaign.engine import Campaign, CampaignOptions
from fuzz.case import Case, GroupCase, SpecCase, SyntheticBackend
from fuzz.corpus.store import Entry, known_signatures
from fuzz.verdict.findings import Finding, observed, variants_of
from tests.conftest import synthetic_info


def two_groups(layout: str = "BLNHC") -> Case:
    full = GroupCase(spec=SpecCase(kind="full", block_size=16), layers=("g0.l0",), backend="A", kernel_block_size=16)
    mla = GroupCase(spec=SpecCase(kind="mla", block_size=16, head_size=32), layers=("g1.l0",),
                    synthetic_backend=SyntheticBackend("beta"), kernel_block_size=16)
    return Case(groups=(full, mla), num_blocks=2, layout=layout)


def test_the_same_error_under_other_spec_kinds_backends_and_layouts_is_one_bug():
    case = two_groups()
    first = observed(case, "crash-on-valid", "create_kv_cache_views", "RuntimeError: setStorage: 4096 bytes past 2048", "g0.l0")
    second = observed(two_groups("LBNHC"), "crash-on-valid", "create_kv_cache_views", "RuntimeError: setStorage: 512 bytes past 256", "g1.l0")
    assert (first.variant, second.variant) == (("full", "A", "BLNHC"), ("mla", "synthetic:beta", "LBNHC"))
    assert first.signature == second.signature == "crash-on-valid | create_kv_cache_views | RuntimeError: setStorage: # bytes past #"
    other = observed(case, "crash-on-valid", "create_kv_cache_views", "ValueError: setStorage: 4096 bytes past 2048", "g0.l0")
    assert other.signature != first.signature, "another error type is another bug"
    assert variants_of([first, second]) == {"spec_kinds": ["full", "mla"], "backends": ["A", "synthetic:beta"], "layouts": ["BLNHC", "LBNHC"]}


def test_the_same_element_size_error_on_other_dtypes_is_one_bug():
    case = two_groups()
    half = observed(case, "crash-on-invalid", "_reshape_kv_cache", "RuntimeError: self.size(-1) must be divisible by 2 to view Char as Half "
                    "(different element sizes), but got 307", "g0.l0")
    bf16 = observed(case, "crash-on-invalid", "_reshape_kv_cache", "RuntimeError: self.size(-1) must be divisible by 2 to view Char as "
                    "BFloat16 (different element sizes), but got 33", "g0.l0")
    assert half.signature == bf16.signature == ("crash-on-invalid | _reshape_kv_cache | RuntimeError: self.size(-#) must be divisible by # "
                                                "to view <dtype> as <dtype> (different element sizes), but got #")


def test_a_refusal_naming_its_backend_is_one_bug_on_every_backend():
    case = two_groups()
    on_a = observed(case, "refused-valid", "map", "ValueError: A needs 64-token kernel blocks; A_MLA is fine", "g0.l0")
    on_beta = observed(case, "refused-valid", "map", "ValueError: synthetic:beta needs 32-token kernel blocks; A_MLA is fine", "g1.l0")
    assert on_a.signature == on_beta.signature == "refused-valid | map | ValueError: <name> needs #-token kernel blocks; <name> is fine"
    registered = observed(case, "refused-valid", "map", "ValueError: SYNTHETIC_BETA needs 8-token kernel blocks; A_MLA is fine", "g1.l0")
    assert registered.signature == on_a.signature, "a synthetic backend goes by its registered name in vLLM's messages"


def test_an_assertion_naming_the_layout_is_one_bug_on_every_layout():
    texts = {layout: f"AssertionError: padding needs L, B outside the tail; got {layout} (LBNHC works)" for layout in ("BHLNC", "LHBNC")}
    found = [observed(two_groups(layout), "assert-on-invalid", "strides", text, "g0.l0") for layout, text in texts.items()]
    expected = "assert-on-invalid | strides | AssertionError: padding needs L, B outside the tail; got <layout> (LBNHC works)"
    assert {f.signature for f in found} == {expected}


def test_a_finding_on_no_particular_layer_names_every_group():
    finding = observed(two_groups(), "hang", "worker", "no answer within 60 s")
    assert finding.variant == ("full+mla", "A+synthetic:beta", "BLNHC")
    assert Finding.from_dict(finding.to_dict()) == finding


def test_a_kept_file_written_before_the_signature_changed_form_still_counts(tmp_path):
    meta = {"kind": "page-escape", "spec_kind": "full", "function": "reshape", "message": "a block's bytes leave its page",
            "signature": "page-escape | full | reshape | a block's bytes leave its page"}
    entry = Entry(tmp_path / "old.json", two_groups(), meta)
    assert entry.expected_signature == "page-escape | reshape | a block's bytes leave its page"
    (tmp_path / "old.json").write_text(json.dumps({**meta, "case": json.loads(json.dumps(_case_dict()))}))
    assert known_signatures(tmp_path) == {entry.expected_signature}


def _case_dict() -> dict:
    from fuzz.case import to_dict

    return to_dict(two_groups())


def test_a_campaign_lists_every_variant_of_a_new_bug_in_its_report_and_corpus_file(tmp_path):
    pool = SimpleNamespace(info=synthetic_info(), source=SimpleNamespace(spec="installed", label="installed"), workers=[0],
                           fuzzers=lambda: [0])
    campaign = Campaign(pool, CampaignOptions(corpus_dir=tmp_path / "findings", seed=4))  # type: ignore[arg-type]
    campaign.start = 0.0
    case = two_groups()
    finding = observed(case, "page-escape", "reshape", "a block's bytes leave its page", "g0.l0")
    record = campaign._record(finding, case, index=3, batch=1)
    assert record is not None and record.path is not None
    campaign._on_batch(0, {"batch": 1, "done": 8, "elapsed": 0.1, "verdicts": {"finding": 3, "pass": 5},
                           "variants": [[finding.signature, "mla", "synthetic:beta", "BLNHC"], [finding.signature, "full", "A", "LBNHC"]]})
    assert campaign._record(observed(case, "page-escape", "reshape", "a block's bytes leave its page", "g1.l0"), case, 4, 1) is None
    campaign._record_variants()
    wanted = {"spec_kinds": ["full", "mla"], "backends": ["A", "synthetic:beta"], "layouts": ["BLNHC", "LBNHC"]}
    assert json.loads(record.path.read_text())["variants"] == wanted
    (reported,) = campaign.report.to_dict()["findings"]
    assert reported["variants"] == wanted and len(campaign.report.findings) == 1
