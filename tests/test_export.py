"""`kvfuzz export` and `kvfuzz report`: standalone regression tests for vLLM, issue drafts and the reach class."""

from __future__ import annotations

import ast
import dataclasses
import io
import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fuzz.cli import main
from fuzz.export.code import NoTemplate, spec_call
from fuzz.export.declared import DECLARED, declared_case, missing, needs_declarations, releases_to_ask
from fuzz.export.finding import read_finding
from fuzz.export.fixes import FIXES, patched_tree
from fuzz.export.reach import reach_of
from fuzz.export.report import Evidence, draft
from fuzz.export.templates import export, export_all
from fuzz.targets import releases

FINDINGS = Path(__file__).resolve().parent.parent / "corpus" / "findings"
# FINDINGS.md number -> corpus file.
CASES = {10: "d12a95e7e436-8b1b57b9bc44668c", 18: "047a3fda9528-b920c268ecdc4248", 19: "bd18d3902f47-37407a51f908b8f4",
         25: "b2cc6e50a21b-8a6683f4aefc2443"}
# What vLLM 0.34.0's backends declare (supported_kv_cache_layouts), as a release reports them.
LAYOUTS_034 = {"CPU_ATTN": ("LBHNC",), "ROCM_SEGMENTED_ATTN": ("LHBNC", "LBHNC"), "CPU_MLA": None}
# The standard library a module may use, pytest, torch and vllm; and triton, vLLM's own dependency, which a module that runs
# one of vLLM's Triton kernels imports (only where the kernel is not compiled already: Triton's interpreter on a CPU).
ALLOWED_IMPORTS = {"copy", "dataclasses", "importlib", "inspect", "os", "sys", "types", "pytest", "torch", "vllm", "triton"}
# A finding kind no template writes: a backend's own declaration (the corpus keeps none since kvfuzz asks a backend whose
# shape reads the GPU as on a GPU that would run it, fuzz/targets/capability.py).
NO_TEMPLATE = {"kind": "declaration", "function": "get_kv_cache_shape"}


def finding(number: int):
    return read_finding(FINDINGS / f"{CASES[number]}.json")


def exported(number: int):
    found = finding(number)
    return export(found, reach_of(found.case, found.meta, LAYOUTS_034))


def imported_roots(source: str) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots.add((node.module or "").split(".")[0])
    return roots


@pytest.mark.parametrize("number", sorted(CASES))
def test_exported_module_is_python_that_imports_only_vllm_and_torch(number):
    source = exported(number).source
    assert imported_roots(source) <= ALLOWED_IMPORTS
    assert "fuzz" not in imported_roots(source) and "oracles" not in imported_roots(source)
    tests = [node.name for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]
    assert len(tests) == 1
    assert source.startswith('"""Regression test for kvfuzz finding')


def test_exported_modules_carry_the_case_as_literals():
    region = exported(18).source
    assert "FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=torch.bfloat16)" in region
    assert 'monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "LHBNC")' in region
    assert 'BACKEND = "ROCM_SEGMENTED_ATTN"' in region and "NUM_BLOCKS = 1" in region
    sharing = exported(25).source
    assert "UniformTypeKVCacheSpecs(block_size=32" in sharing and "num_kv_heads=2" in sharing
    assert "SHARED_LAYERS = {" in sharing and "VLLM_KV_CACHE_LAYOUT" not in sharing  # CPU_ATTN's own layout
    write = exported(19).source
    assert "MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, cache_dtype_str=\"auto\")" in write
    assert "BLOCK, POSITION = 1, 3" in write
    quant = exported(10).source
    assert 'CACHE_DTYPE = "kvfuzz_int8_custom"' in quant and "return KVQuantMode.CUSTOM" in quant


def test_reach_classes():
    kinds = {number: reach_of(finding(number).case, finding(number).meta, LAYOUTS_034) for number in CASES}
    assert kinds[10].kind == "latent"
    assert kinds[18].kind == "flag" and kinds[18].overrides == ("VLLM_KV_CACHE_LAYOUT=LHBNC",)
    assert kinds[19].kind == "flag" and kinds[19].overrides == ("VLLM_KV_CACHE_LAYOUT=BLNHC",)
    assert kinds[25].kind == "deployment" and kinds[25].settings  # the offloading connector is switched on, not an override
    # A layout the backend does not declare is refused by vLLM's layout resolution before the code runs.
    refused = reach_of(finding(25).case, finding(25).meta, {"CPU_ATTN": ("LBNHC",)})
    assert refused.kind == "latent"


@pytest.mark.parametrize("ratio, kind", [(512, "latent"), (128, "deployment"), (4, "deployment")])
def test_a_compress_ratio_no_shipped_model_uses_is_latent(ratio, kind):
    # #5's shipped-backend case: DEEPSEEK_V4_FLASHMLA with compress_ratio 512, a ratio no DeepSeek V4 compressor takes.
    found = read_finding(FINDINGS / "65db93299de2-257753d4d7ef2742.json")
    case = dataclasses.replace(found.case, groups=tuple(
        dataclasses.replace(g, spec=dataclasses.replace(g.spec, compress_ratio=ratio)) for g in found.case.groups))
    reach = reach_of(case, found.meta, {"DEEPSEEK_V4_FLASHMLA": None})
    assert reach.kind == kind, reach.why


def test_a_spec_page_module_expects_the_page_the_cache_dtype_stores():
    # #22: an int4_per_token_head sliding-window layer, 16 tokens of one KV head of size 16. Per token, K and V take
    # 16 int4 values each (8 bytes), plus one fp32 scale per side: 8 + 8 + 4 + 4 = 24 bytes; 16 tokens: 384.
    found = read_finding(FINDINGS / "85b8aab0afe1-1f2526231008618d.json")
    source = export(found, None).source
    assert "EXPECTED_PAGE_BYTES = 384" in source
    assert 'kv_quant_mode=get_kv_quant_mode("int4_per_token_head")' in source
    assert 'if "INT4_PER_TOKEN_HEAD" not in KVQuantMode.__members__:' in source
    assert "import types" not in source  # a comment naming oracles/dtypes.py is no use of the types module


def test_a_quantized_spec_keeps_its_quant_mode_beside_the_fields_a_release_may_lack():
    from fuzz.case import SpecCase

    spec = SpecCase("full", 16, head_size=16, dtype="int8", cache_dtype="int8_per_token_head",
                    kv_quant_mode="int8_per_token_head", state_content_bytes=40)
    call = spec_call(spec)
    assert 'kv_quant_mode=get_kv_quant_mode("int8_per_token_head")' in call
    assert call.endswith("**held_by(FullAttentionSpec, state_content_bytes=40))")


def test_a_block_copy_module_expects_each_layers_block_bytes_moved():
    # #23: ROCM_ATTN's K/V-first NHD cache, 2 blocks of 16 tokens x 1 head x 2 bfloat16: a block's K (or V) is
    # 16 * 2 * 2 = 64 bytes, K of both blocks first (128 bytes), then V. Block 1 owns [64, 128) and [192, 256).
    found = read_finding(FINDINGS / "c9eda79b51f9-2bb864d6f8cdd633.json")
    source = export(found, None).source
    assert "SRC, DST = 0, 1" in source
    assert '"blocks": {0: [(0, 64), (128, 192)], 1: [(64, 128), (192, 256)]}' in source
    assert "copy_kv_cache_blocks_inplace([view for view in kv_caches.values()" in source


def test_a_block_copy_module_holds_each_layer_to_its_own_block_where_layers_overlap():
    """Copying block 1 to 0 where one layer's block 1 lies inside another's (0.34's layer-outer plan of a sparse MLA layer
    whose blocks are 3,136 bytes apart beside Mamba layers 3,088 apart): whichever layer vLLM copies last, the other's
    block 0 misses bytes of its block 1, and the module says which; a copy that leaves both right passes."""
    from fuzz.export.block_copy import COPY_HELPERS

    namespace = {"torch": torch}
    exec(textwrap.dedent(COPY_HELPERS), namespace)  # noqa: S102 - the helper the module holds, run on a made-up layout
    raw = torch.arange(16, dtype=torch.uint8)
    one, two = raw[0:8].view(2, 4), raw[2:14].view(2, 6)  # the layers' blocks: [0, 4) [4, 8) and [2, 8) [8, 14)
    expected = {"a": [{"blocks": {0: [(0, 4)], 1: [(4, 8)]}}], "b": [{"blocks": {0: [(2, 8)], 1: [(8, 14)]}}]}
    kv_caches = {"a": one, "b": two}
    buffers = {raw.untyped_storage().data_ptr(): raw}
    before = {pointer: view.clone() for pointer, view in buffers.items()}
    one[0] = one[1].clone()
    two[0] = two[1].clone()  # overwrites bytes 2 - 4 of a's block 0
    wrong, escaped = namespace["copy_faults"](kv_caches, expected, before, buffers, 1, 0)
    assert escaped is None and list(wrong) == ["a (tensor 0)"] and wrong["a (tensor 0)"] == (2, (0, 2))
    raw.copy_(before[raw.untyped_storage().data_ptr()])
    raw[0:2] = torch.tensor([4, 5], dtype=torch.uint8)
    raw[15] = 0  # a byte outside every layer's block 0
    wrong, escaped = namespace["copy_faults"](kv_caches, expected, before, buffers, 1, 0)
    assert escaped == (1, (0, 15)) and set(wrong) == {"a (tensor 0)", "b (tensor 0)"}


def test_a_module_expects_the_block_stride_a_backend_publishes_and_carries_the_alignments_a_case_sets():
    """0.34's FLASHINFER_MLA_SPARSE keeps whole 64-byte rows: its blocks lie 3,136 bytes apart for a 3,088-byte page. The
    corpus file keeps what the release published (`declared`), the expectation lays the MLA layer out at that stride,
    and the Mamba spec carries its own alignments, skipping a release whose spec class lacks them."""
    found = read_finding(FINDINGS / "2b4034d64613-6f2bf0d8ea712957.json")
    assert found.meta[DECLARED]["0.34.0"][0] == {"block_stride_alignment": 64}
    source = export(found, None).source
    assert '"byte_strides": (3136, 2, 2, 2)' in source and '"byte_strides": (3088, 704, 704, 1)' in source
    assert "**fields_of(MambaSpec, block_stride_alignment=16, state_alignment=16))" in source
    assert "def fields_of(cls, **fields):" in source
    assert "block_stride_alignment" not in source.split("spec_0 = ")[1].split("\n")[0]  # the backend publishes it in vLLM


def test_a_block_copy_on_both_sides_of_029_gets_a_module_per_walk():
    found = read_finding(FINDINGS / "2b4034d64613-78e4cb8b8970a7b7.json")  # 0.26.0 and 0.29.0 - 0.33.0
    with pytest.raises(NoTemplate, match="one module per walk"):
        export(found, None)
    before, after = export_all(found, None)
    assert (before.file_name, after.file_name) == ("test_kvfuzz_2b4034d64613_78e4cb8b_before_0_29.py",
                                                   "test_kvfuzz_2b4034d64613_78e4cb8b_from_0_29.py")
    assert 'CONTRACTS = ("shaped-0.24", "shaped-0.27")' in before.source and "_reshape_kv_cache" in before.source
    assert 'CONTRACTS = ("placed-0.29", "placed-0.32")' in after.source and "allocate_kv_cache(" in after.source
    assert [m.file_name for m in export_all(finding(18), None)] == ["test_kvfuzz_047a3fda9528_b920c268.py"]


def test_a_cpu_zeroing_module_expects_the_whole_manager_block_cleared():
    # #17: CPU_MLA's 32-token blocks of one 16-wide bfloat16 latent head (32 * 16 * 2 = 1024 bytes a block) split into
    # 16-token kernel blocks, beside a Mamba layer whose page is padded to the same 1024 bytes; two blocks, the layout
    # LBNHC. Zeroing manager block 1 may change [1024, 2048) only (the bug clears kernel block 1, bytes [512, 1024) of
    # block 0): a zero-escape module holds vLLM to that half of the rule.
    found = read_finding(FINDINGS / "f92d5951ceca-48e032ba503b2c5b.json")
    source = export(found, None).source
    assert '"placed-0.32": [\n        {"buffer_of": ("model.layers.0.self_attn.attn", 0), "may_change": [(1024, 2048)]},' in source
    assert "must_clear\": [" not in source
    assert "lambda: zero_block(kv_cache_config, kv_caches, attn_groups, kernel_block_sizes, BLOCK))" in source
    assert "    [],  # a Mamba group: no attention backend takes part in its views" in source
    # #29: CPU_MLA (16 tokens x 3 x bfloat16: a 96-byte page) and AMX_MLA (32 x 453 x float16: 28,992 bytes) in a
    # block-outermost pool: both views start at byte 0 of block 0, whose row is the larger page.
    found = read_finding(FINDINGS / "0c4c97c48f4c-e88780287632ed2b.json")
    source = export(found, reach_of(found.case, found.meta, None)).source
    assert '{"buffer_of": ("model.layers.0.self_attn.attn", 0), "must_clear": [(0, 28992)]}' in source
    assert 'monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "BLNHC")' in source


def test_a_connector_module_before_029_holds_the_region_to_the_blocks_the_oracle_gives():
    # A synthetic cross-attention backend declaring the K/V-first shape (2, num_blocks, block_size, heads, head_size),
    # 2 blocks of one token, one head of 16 bfloat16: one block's K (or V) is 16 * 2 = 32 bytes, K of both blocks first.
    # Block 0 owns [0, 32) and [64, 96); the connector's row of a 64-byte page, [0, 64), also holds block 1's K.
    found = read_finding(FINDINGS / "1964babdb04d-e703ed0da6e7af14.json")
    source = export(found, None).source
    assert '"blocks": {0: [(0, 32), (64, 96)], 1: [(32, 64), (96, 128)]}' in source
    assert "connector = offloading_worker(spec, vllm_config, kv_cache_config)" in source
    assert "expected = EXPECTED[release_contract()]" in source


def test_a_zeroer_constructor_module_builds_the_runners_zeroer_on_the_views():
    # #27 on 0.28: DEEPSEEK_V4_FLASHMLA's compressed sliding-window MLA cache beside a Mamba layer (so vLLM zeroes), one
    # block. The module walks to the views and builds KVBlockZeroer as the runner does; no kernel runs.
    found = read_finding(FINDINGS / "e63d845d32da-5569d6510efbff52.json")
    source = export(found, reach_of(found.case, found.meta, None)).source
    assert 'build_zeroer(kv_caches, attn_groups, kernel_block_sizes, "fp8_ds_mla")' in source
    assert 'CONTRACTS = ("shaped-0.27",)' in source
    assert "zero_block_ids(" not in source


def test_a_triton_zeroing_module_runs_the_runners_zeroer_on_the_views():
    # #21: TRITON_ATTN's sliding-window layer (16 tokens x 1 head x 16 bfloat16, K and V: 1,024 bytes a block) beside a
    # Mamba layer padded to the same page, one block: zeroing block 0 must clear [0, 1024) of their one buffer. The
    # module builds KVBlockZeroer as the runner does and runs its Triton kernel (under the interpreter on a CPU).
    found = read_finding(FINDINGS / "e1619f3c765d-9c7782ebc01380b0.json")
    source = export(found, reach_of(found.case, found.meta, None)).source
    assert '"shaped-0.23": [\n        {"buffer_of": ("model.layers.0.self_attn.attn", 0), "must_clear": [(0, 1024)]},' in source
    assert 'kernel_runnable_here(monkeypatch, sys.modules[KVBlockZeroer.__module__], "_zero_kv_blocks_kernel")' in source
    assert "check_zeroing(kv_caches, ZEROING[release_contract()], BLOCK, zero)" in source
    assert "    zeroer.zero_block_ids([BLOCK])" in source
    assert "\nimport os\n" in source and "\nimport types\n" in source


def test_a_zeroer_whose_stores_pass_the_cache_is_held_to_clearing_its_block_and_to_storing_inside_the_cache():
    """#27 past the cache (0.28): zeroing block 1 of two writes the 2,048 bytes after the cache. Inside the buffers that shows
    as block 1 left as it was, so the module checks what must be cleared; under Triton's interpreter it drops the stray
    stores (they would corrupt the test process) and fails on their count."""
    found = read_finding(FINDINGS / "4fcbea419a76-f93e86d1c02bfbdd.json")
    source = export(found, None).source
    assert '"must_clear": [(1024, 2048)]' in source and '"may_change": [' not in source
    assert "stray = guard_stores(monkeypatch, kv_caches)" in source
    assert 'assert not stray[0], f"zeroing block {BLOCK} stores {stray[0]} bytes outside every buffer of the cache"' in source


def test_an_mla_layer_spec_module_asks_vllms_layer_for_its_spec():
    # #13: MLAAttention.get_kv_cache_spec for an fp8 cache of head size 2 (0.20 - 0.25 leave kv_quant_mode NONE): the
    # mode the module expects is the oracle's for fp8, not vLLM's own lookup.
    found = read_finding(FINDINGS / "afdf51c97da3-adae1fbedccee18f.json")
    source = export(found, None).source
    assert 'EXPECTED_MODE = "FP8_PER_TENSOR"' in source and 'CACHE_DTYPE = "fp8"' in source and "HEAD_SIZE = 2" in source
    assert 'spec = mla_layer("model.layers.0.self_attn.attn").get_kv_cache_spec(vllm_config)' in source
    assert "get_kv_quant_mode(" not in source


def test_a_runner_comparison_module_holds_both_runners_views_to_one_layout():
    # #20: a synthetic backend declaring [B, H, T, 2*D] with 2-token kernel blocks, 4-token blocks: the V1 runner splits
    # each block into two kernel blocks and the V2 runner (before 0.22) does not, so the module reads each runner's view
    # as [block, token, head, content] by the declared axes and compares the bytes.
    found = read_finding(FINDINGS / "4d24ab554c06-cef5452a85f1f631.json")
    source = export(found, None).source
    assert "AXES_0 = ('B', 'H', 'T', 'D')" in source
    assert 'kv_caches = reshape_kv_cache(kv_cache_config, attn_groups, kernel_block_sizes, "auto")' in source
    assert 'v1_caches = v1_kv_caches(vllm_config, kv_cache_config, attn_groups, kernel_block_sizes, "auto")' in source
    assert 'CONTRACTS = ("shaped-0.19", "shaped-0.20", "shaped-0.21", "shaped-0.22")' in source


def without_template(folder: Path) -> Path:
    """A copy of #18's corpus file as a finding of a kind no template writes."""
    data = {**json.loads((FINDINGS / f"{CASES[18]}.json").read_text()), **NO_TEMPLATE}
    path = folder / "declaration.json"
    path.write_text(json.dumps(data))
    return path


def test_a_kind_without_a_template_says_so(tmp_path):
    with pytest.raises(NoTemplate, match="no exporter for declaration"):
        export(read_finding(without_template(tmp_path)), None)


def test_export_command(tmp_path):
    out = io.StringIO()
    declaration = without_template(tmp_path)
    status = main(["export", str(FINDINGS / f"{CASES[18]}.json"), str(declaration), "--out", str(tmp_path / "tests")], stdout=out)
    assert status == 0
    lines = out.getvalue().splitlines()
    assert any("not exported: no exporter for declaration in get_kv_cache_shape" in line for line in lines)
    assert [p.name for p in (tmp_path / "tests").iterdir()] == ["test_kvfuzz_047a3fda9528_b920c268.py"]
    # Nothing exported: exit 1, one line per finding.
    assert main(["export", str(declaration), "--out", str(tmp_path / "none")], stdout=io.StringIO()) == 1


def test_export_and_report_refuse_bad_input_in_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    for argv in (["export", str(tmp_path / "missing.json"), "--out", str(tmp_path)], ["report", str(bad)],
                 ["report", str(tmp_path / "missing.json")]):
        err = io.StringIO()
        assert main(argv, stdout=io.StringIO(), stderr=err) == 2
        assert len(err.getvalue().strip().splitlines()) == 1 and err.getvalue().startswith("kvfuzz: error: ")
    not_a_finding = tmp_path / "case.json"
    not_a_finding.write_text(json.dumps({"groups": [], "num_blocks": 1}))
    assert main(["report", str(not_a_finding)], stdout=io.StringIO(), stderr=io.StringIO()) == 2


def test_report_sections():
    found = finding(18)
    reach = reach_of(found.case, found.meta, LAYOUTS_034)
    module = export(found, reach)
    evidence = Evidence("0.34.0", "full/ROCM_SEGMENTED_ATTN/LHBNC ...", "fail", ("AssertionError: block 0: the region misses bytes",))
    text = draft(found, reach, module, module.title, evidence)
    for heading in ("# [Bug]: ", "## Releases affected", "## Reach", "## Configuration", "## Expected and actual", "## Proposed fix",
                    "## Regression test", "## Reproduce with kvfuzz"):
        assert heading in text
    assert "0.32.0, 0.33.0, 0.34.0" in text and "**flag**" in text and "`VLLM_KV_CACHE_LAYOUT=LHBNC`" in text
    assert "OffloadingConnector" in text and module.source.strip() in text and "```diff" in text


def _release_tree(version: str) -> Path:
    try:
        source = releases.resolve(version, fetch=False)
    except Exception:  # noqa: BLE001 - not in the cache: the check needs it
        pytest.skip(f"vLLM {version} is not in kvfuzz's release cache")
    assert source.python_path is not None
    return source.python_path


def write_exported(numbers: list[int], folder: Path) -> dict[int, Path]:
    paths = {}
    for number in numbers:
        module = exported(number)
        paths[number] = folder / module.file_name
        paths[number].write_text(module.source)
    return paths


@pytest.mark.slow
@pytest.mark.releases
@pytest.mark.parametrize("number", sorted(CASES))
def test_exported_test_passes_on_034_with_the_fix(number, tmp_path):
    """Each exported module, in a process without kvfuzz, passes on 0.34.0 with kvfuzz's proposed fix for its finding
    alone applied (no release fixes these)."""
    from fuzz.export.isolated import run_isolated

    tree = _release_tree("0.34.0")
    path = write_exported([number], tmp_path)[number]
    fixed = run_isolated(path, patched_tree(tree, FIXES[finding(number).signature_id], tmp_path / "fixed"))
    assert fixed.outcome == "pass", fixed.output[-3000:]
    assert "is importable" not in fixed.output


# Candidates (FINDINGS.md) no exporter writes yet, each with the reason `kvfuzz export` gives: every numbered finding exports.
UNEXPORTED_CANDIDATES = {
    "98c17caf40ef-c612c29e04108198": "a synthetic backend without a declared shape, or with a packed or scaled cache",
    "88ed08241b78-7f7aa10f5191300c": "no exporter for assert-on-invalid in _apply_prefix_caching yet",
    "6bf526144df0-40d1d121af3e7061": "no exporter for assert-on-invalid in _validate_remote_agent_handshake yet",
    "9e87973cf58d-08c18f873cae1bd7": "no exporter for transfer-mismatch in register_kv_caches yet",
    "ad637d244468-2c5c9e0cadee36bd": "no exporter for transfer-mismatch in register_kv_caches yet",
    "3f075c5373b5-1dcc94a69f4f4909": "no exporter for transfer-mismatch in register_kv_caches yet",
    "3f075c5373b5-22f84325d4cf574d": "no exporter for transfer-mismatch in register_kv_caches yet",
    "32f9fc370aa2-80bd6844ddfeedaf": "no exporter for fill-miss in _fill_block_tensor yet",
    "32f9fc370aa2-ea5622ccbe75254e": "no exporter for fill-miss in _fill_block_tensor yet",
    "3f075c5373b5-971d93925712bf21": "no exporter for transfer-mismatch in register_kv_caches yet",
    "585b7fdbefaf-4b211623bcfc1410": "no exporter for workers-layers in get_kv_cache_configs yet",
    "585b7fdbefaf-932244dc75162846": "no exporter for workers-layers in get_kv_cache_configs yet",
    "810046d27e97-d3c02aaf5dd3423b": "no exporter for transfer-wrong in start_load_kv yet",
    "8118bd65f75d-439b6bc792d18a43": "no exporter for crash-on-valid in extract_kv_from_layer yet",
    "e7ed22683da9-04ecf926d81c0dcd": "no exporter for fill-stray in _fill_block_tensor yet",
    "4a3626a9f0d2-af33342fdc89e97a": "no exporter for refused-valid in is_mla_cache_layer yet",
    "4febcf611a7e-828903b30694c201": "no exporter for transfer-mismatch in _compute_block_transfer_offsets yet",
    "7daa4b976b96-bd454b6c11ad9263": "no exporter for transfer-wrong in start_load_kv yet",
    "8296e3c7e2d5-29ffce583cd92174": "no exporter for readback-error in triton_reshape_and_cache_flash yet",
    "91fb613fddeb-b2147e7da5ce09c1": "no exporter writes cross+sliding_window/ROCM_ATTN+TRITON_ATTN/NHD/both yet (both model runners, "
        "platform or vLLM-built specs)",
    "a1c92104b7cf-59def9f9073c0b17": "no exporter writes sink+chunked_local+mamba/ROCM_AITER_UNIFIED_ATTN+ROCM_ATTN+none/HND/both yet "
        "(both model runners, platform or vLLM-built specs)",
    "047a3fda9528-83f529b5dea91898": "no exporter writes "
        "sliding_window+cross+full/ROCM_AITER_UNIFIED_ATTN+ROCM_ATTN+ROCM_AITER_UNIFIED_ATTN/HND/both/cross_layers yet "
        "(both model runners, platform or vLLM-built specs)",
    "2866d43be3fd-0671b91fe4f5346a": "no exporter for transfer-mismatch in register_kv_caches yet",
    "0d55dff5e762-00e5697ce74b70b5": "no exporter for transfer-wrong in send_kv_to_decode yet",
    "0d55dff5e762-1c2cccb119bb335c": "no exporter for transfer-wrong in send_kv_to_decode yet",
    "f30e10b81dff-b24875bbff002fc6": "no exporter for transfer-overlap in register_kv_caches yet",
    "f30e10b81dff-bfa69aa03b335b1e": "no exporter for transfer-overlap in register_kv_caches yet",
    "aac71ff7c28d-ef324b319e5a8331": "no exporter writes sink/synthetic:beta/BHLNC/rocm yet (runner, packing, platform or vLLM-built specs)",
    "cbc8e1ed099a-33ab8fd4b50ba9c3": "no exporter for crash-on-valid in bind_kv_cache yet",
    "cbc8e1ed099a-d6fa183ae7e3ba72": "no exporter for crash-on-valid in bind_kv_cache yet",
    "39d535861cd0-97f79fb480b434e4": "no exporter for crash-on-valid in bind_kv_cache yet",
    "39d535861cd0-abc9ca9c3901f2d7": "no exporter for crash-on-valid in bind_kv_cache yet",
    "5ce097856a9d-e77287a82e71b293": "no exporter for buffer-size in allocate yet",
    "2b395bd3c658-94dafa4d03dfb422": "the NIXL receive exporter covers blocks that are one run per layer; BLNHC with 2 layer(s) is not",
    "2b395bd3c658-8c2a25156bd5c2eb": "the NIXL receive exporter covers blocks that are one run per layer; BHLNC with 1 layer(s) is not",
    "2b395bd3c658-b8c3f42126b9feca": "the NIXL receive exporter covers blocks that are one run per layer; BHLNC with 2 layer(s) is not",
    "6bf526144df0-3341a880e4a556d1": "no exporter for assert-on-invalid in _validate_remote_agent_handshake yet",
    "2b395bd3c658-e3a843f048ffc862": "the NIXL receive exporter covers blocks that are one run per layer; BHLNC with 1 layer(s) is not",
    "2b395bd3c658-7c0c6f2012890f10": "the NIXL receive exporter covers models without KV-sharing layers",
    "2b395bd3c658-1f29844ea1602d05": "the NIXL receive exporter covers transfers into larger blocks; this one's peer is 'same'",
    "2b395bd3c658-9e6e42a9d1828df0": "the NIXL receive exporter covers blocks that are one run per layer; BLNHC with 2 layer(s) is not",
    "cae353e83ba8-f8d1041deaee4684": "no exporter for refused-valid in select_common_block_size yet",
    "2b395bd3c658-8b887f98e5f290ce": "the NIXL receive exporter covers blocks that are one run per layer; BHLNC with 2 layer(s) is not",
    "aff962522f6b-167bc0eb94dffe1d": "no exporter for assert-on-invalid in register_kv_caches yet",
    "c0202453d2d8-8d7c1dbbdf84bc8e": "no exporter for assert-on-invalid in _validate_remote_agent_handshake yet",
    "2b395bd3c658-fb89b41977ade18c": "the NIXL receive exporter covers blocks that are one run per layer; BLNHC with 2 layer(s) is not",
    "f30e10b81dff-fa1c2687429e4530": "no exporter for transfer-overlap in register_kv_caches yet",
    "88076f640e5b-9edc09047ce7b839": "no exporter stores cache dtype fp8_inc yet (the case gives it no quant mode)",
    "1964babdb04d-01cf480bc2bc776d": "no exporter builds models of several KV-cache groups (or without a shipped backend) yet",
    "e63d845d32da-959336ba995a2819": "the zeroer-constructor exporter writes vLLM 0.23 - 0.28's views only",
    "781946f11671-257cb310c4a6fb01": "no exporter writes sliding_window/synthetic:beta/BHLNC/rocm yet (runner, packing, platform or "
                                     "vLLM-built specs)",
}


def test_the_whole_corpus_exports_and_each_module_parses(tmp_path):
    out = io.StringIO()
    assert main(["export", "corpus", "--out", str(tmp_path)], stdout=out) == 0
    corpus = sorted(FINDINGS.glob("*.json"))
    exported = len(corpus) - len(UNEXPORTED_CANDIDATES)
    assert f"exported {exported} of {len(corpus)} finding(s)" in out.getvalue(), out.getvalue()
    for stem, reason in UNEXPORTED_CANDIDATES.items():
        assert read_finding(FINDINGS / f"{stem}.json").meta["finding"] == "candidate"
        assert f"{stem}.json: not exported: {reason}" in out.getvalue()
    modules = sorted(tmp_path.glob("test_kvfuzz_*.py"))
    assert len(modules) >= exported
    for module in modules:
        source = module.read_text()
        assert imported_roots(source) <= ALLOWED_IMPORTS, module.name
        tests = [node.name for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]
        assert len(tests) == 1, module.name


def view_module(stem: str):
    found = read_finding(FINDINGS / f"{stem}.json")
    return export(found, reach_of(found.case, found.meta, None))


def test_view_modules_carry_the_rule_the_expectation_and_the_contracts():
    # A valid case before 0.29 (a synthetic backend beside a Mamba layer): the views per contract, as plain numbers.
    valid = view_module("aac71ff7c28d-5269973ff7dfcfb3").source
    assert 'CONTRACTS = ("shaped-0.21", "shaped-0.22")' in valid and "EXPECTED = {" in valid
    assert '"shape": (2, 16, 1, 32)' in valid and "0: [(0, 1024)]" in valid
    assert "class SyntheticAlphaBackend(AttentionBackend):" in valid and "return (num_blocks, block_size, num_kv_heads, 2 * head_size)" in valid
    assert "MambaSpec(block_size=16, shapes=((4, 16),), dtypes=(torch.float32,), page_size_padded=1024)" in valid
    assert "check_views(kv_caches, EXPECTED[release_contract()])" in valid
    # An invalid case on 0.29+: vLLM must refuse it, with the oracle's reason quoted.
    invalid = view_module("0c54c1bb01ae-65dc68d7c07d77cf").source
    assert "with pytest.raises((ValueError, NotImplementedError)):" in invalid and "EXPECTED" not in invalid
    assert "a kernel block must hold a whole number of compressed states" in invalid.replace("\n    # ", " ")
    assert 'monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "LBNHC")' in invalid  # a synthetic backend runs the case's layout
    # A backend a model brings (outside vLLM's registry) is imported from where the release keeps it.
    model_backend = view_module("2b00d49a5da4-44c36a965992e553").source
    assert "backend_class(BACKEND, (" in model_backend and "vllm.models.deepseek_v4" in model_backend


def test_view_exporter_names_what_it_cannot_write():
    # #16's synthetic backends before 0.29, storing an fp8 cache (one byte a value: their declared shape holds it) and, in
    # a variant, a scaled int8 one (values and per-token scales: a page no declared shape describes).
    source = view_module("ed2cb5be4dc4-30a819fe108964c1").source
    assert 'kv_quant_mode=get_kv_quant_mode("fp8_inc")' in source and "with pytest.raises((ValueError, NotImplementedError)):" in source
    found = read_finding(FINDINGS / "ed2cb5be4dc4-30a819fe108964c1.json")
    scaled = [dataclasses.replace(g, spec=dataclasses.replace(g.spec, dtype="int8", cache_dtype="int8_per_token_head",
                                                             kv_quant_mode="int8_per_token_head")) for g in found.case.groups]
    with pytest.raises(NoTemplate, match="synthetic backend without a declared shape, or with a packed or scaled cache"):
        export(dataclasses.replace(found, case=dataclasses.replace(found.case, groups=tuple(scaled))), None)
    # A shipped backend's declared cache shape (vLLM <= 0.28) comes from its release: without one, no expectation.
    found = read_finding(FINDINGS / "ca0f737b67c6-8abd1e5d56c29dc4.json")
    unasked = dataclasses.replace(found, meta={key: value for key, value in found.meta.items() if key != DECLARED})
    with pytest.raises(NoTemplate, match="declared cache shape"):
        export(unasked, None)


def test_declared_shapes_come_from_the_release_of_each_contract():
    """Finding 2 on ROCM_ATTN affects 0.21 - 0.26: its file keeps what the newest affected release of each contract
    declared, and the first release of the next contract (0.27.0, where a fix would show), and the expectation under a
    contract is laid out from that contract's declaration (else the nearest older one's)."""
    found = read_finding(FINDINGS / "ca0f737b67c6-8abd1e5d56c29dc4.json")
    assert needs_declarations(found) and not missing(found)
    assert releases_to_ask(found) == ["0.21.0", "0.22.1", "0.23.0", "0.26.0", "0.27.0"]
    assert sorted(found.meta[DECLARED]) == ["0.21.0", "0.22.1", "0.23.0", "0.26.0", "0.27.0"]
    # Two releases that declared differently (made up: the recorded ones agree).
    older, newer = [[2, "B", "T", 1, 16], [0, 1, 2, 3, 4]], [["B", 2, "T", 1, 16], [1, 0, 2, 3, 4]]
    told = dataclasses.replace(found, meta={**found.meta, DECLARED: {"0.21.0": [older, None], "0.26.0": [newer, None]}})
    assert declared_case(told, "shaped-0.21").groups[0].declared_shape == (2, "B", "T", 1, 16)
    assert declared_case(told, "shaped-0.23").groups[0].declared_stride_order == (0, 1, 2, 3, 4)  # the nearest older
    assert declared_case(told, "shaped-0.24").groups[0].declared_shape == ("B", 2, "T", 1, 16)
    assert declared_case(told, "shaped-0.20").groups[0].declared_shape == (2, "B", "T", 1, 16)  # none older: the oldest
    assert declared_case(told, "shaped-0.24").groups[1].declared_shape is None  # the Mamba group declares nothing
    assert "EXPECTED = {" in export(found, None).source
    # The next contract is checked only with its own release's declaration: a backend's declared shape changes between
    # contracts (TRITON_ATTN_DIFFKV's did from 0.25 to 0.27), so an older one would expect views no release builds.
    from fuzz.export.expected import contracts

    assert contracts(found)[-1] == "shaped-0.27"
    older_only = dataclasses.replace(found, meta={**found.meta, DECLARED: {k: v for k, v in found.meta[DECLARED].items() if k != "0.27.0"}})
    assert "shaped-0.27" not in contracts(older_only)


def test_isolated_run_cannot_import_kvfuzz(tmp_path):
    from fuzz.export.isolated import run_isolated

    probe = tmp_path / "test_probe.py"
    probe.write_text("import importlib.util\n\n\ndef test_no_kvfuzz():\n    assert importlib.util.find_spec('fuzz') is None\n")
    run = run_isolated(probe, None, timeout=120)
    assert run.outcome == "pass", run.output[-2000:]
    assert sys.executable  # the same interpreter: torch and pytest without kvfuzz
