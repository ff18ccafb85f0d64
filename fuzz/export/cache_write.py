"""Template: a backend's own cache write must take a cache dtype the backend declares (`kernel-crash` in
`do_kv_cache_update` or the Triton writers it calls): written through the backend's impl into a cache of the backend's own
declared shape, a token's K and V values must land in the cache, in its block, and nothing else may change. The Triton
writers run compiled where Triton has a GPU, else under Triton's interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

from fuzz.checks.protocol import Check
from fuzz.export import runner_steps
from fuzz.export.code import Module, NoTemplate, docstring, indent
from fuzz.export.finding import FindingFile
from fuzz.export.reach import Reach
from fuzz.export.triton_zero import RUNNABLE
from fuzz.targets.kernel_probe import PLAIN_CACHE  # the caches the probe writes, whose findings this exports

WRITERS = "vllm.v1.attention.ops.triton_reshape_and_cache_flash"
# Blocks in the test's cache: a prime no other axis of a small attention cache has, so that its block axis is found.
NUM_BLOCKS = 5

WRITE = '''
    class Layer:
        """What a cache write reads of its attention layer: the K and V scales (1: unquantized caches)."""

        def __init__(self):
            self._k_scale = self._v_scale = torch.ones((), dtype=torch.float32)
            self._k_scale_float = self._v_scale_float = 1.0


    def impl_of(backend):
        """The backend's impl as a decoder layer of these heads has it, from its own constructor."""
        arguments = {"num_heads": NUM_KV_HEADS, "head_size": HEAD_SIZE, "scale": HEAD_SIZE ** -0.5, "num_kv_heads": NUM_KV_HEADS,
                     "alibi_slopes": None, "sliding_window": None, "kv_cache_dtype": CACHE_DTYPE, "logits_soft_cap": None,
                     "attn_type": "decoder", "kv_sharing_target_layer_name": None}
        impl_cls = backend.get_impl_cls()
        parameters = inspect.signature(impl_cls).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            return impl_cls(**arguments)  # a subclass passing its arguments on to its base's constructor
        return impl_cls(**{name: value for name, value in arguments.items() if name in parameters})


    def runnable_writers(monkeypatch):
        """vLLM's Triton cache writers, runnable here (kernel_runnable_here), and asked as on a GPU of compute capability 9.0
        where a launcher gates a dtype or a tile on it (the CPU platform and a CPU build of torch report none)."""
        from vllm.platforms.interface import DeviceCapability

        writers = importlib.import_module(WRITERS)
        for name in [name for name in vars(writers) if name.startswith("reshape_and_cache_kernel")]:
            kernel_runnable_here(monkeypatch, writers, name)
        if os.environ.get("TRITON_INTERPRET") == "1":  # the launchers' own triton / tl (a CPU build's placeholders)
            import triton
            import triton.language as tl

            for name, real in (("triton", triton), ("tl", tl)):
                if getattr(writers, name, real) is not real:
                    monkeypatch.setattr(writers, name, real)
        monkeypatch.setattr(type(current_platform), "get_device_capability", classmethod(lambda cls, device_id=0: DeviceCapability(9, 0)))
        if not torch.cuda.is_available():
            monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args, **kwargs: (9, 0))
'''


def cache_write_test(finding: FindingFile, reach: Reach | None, check: Check) -> Module:
    case = finding.case
    layer = finding.meta.get("layer")
    group = case.groups[case.group_of(layer)] if layer else runner_steps.check_case(finding)
    spec = group.spec
    if spec.cache_dtype not in PLAIN_CACHE or spec.dtype not in ("float16", "bfloat16", "float32") or group.synthetic_backend is not None:
        raise NoTemplate("the cache-write exporter covers shipped backends' unquantized caches only")
    if spec.kind not in ("full", "sliding_window", "cross", "chunked_local", "sink") or spec.head_size_v not in (None, spec.head_size):
        raise NoTemplate("the cache-write exporter writes attention layers with K and V heads of one size only")
    tokens = case.touches.tokens if case.touches else ()
    block, position = tokens[0] if tokens else (1, 0)
    block, position = block % NUM_BLOCKS, position % spec.block_size
    module = Module(title=f"{group.backend}'s cache write fails on a {spec.cache_dtype} cache of the shape it declares")
    module.add(docstring(finding, reach, f"{group.backend}'s cache write must take a cache dtype the backend declares "
                                         f"({spec.cache_dtype}) and put the token where the cache keeps it."))
    module.add("\n".join([
        f'BACKEND = "{group.backend}"',
        f'CACHE_DTYPE = "{spec.cache_dtype}"',
        f"DTYPE = torch.{spec.dtype}",
        f"NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE = {NUM_BLOCKS}, {spec.block_size}, {spec.num_kv_heads}, {spec.head_size}",
        f"BLOCK, POSITION = {block}, {position}  # the token written",
        f'WRITERS = "{WRITERS}"']))
    module.add(RUNNABLE)
    module.add(WRITE, "current_platform")
    lookup = runner_steps.shipped_backend("backend", "BACKEND", group.backend, module)
    body = "\n".join([
        *lookup,
        "if CACHE_DTYPE not in backend.supported_kv_cache_dtypes:",
        '    pytest.skip(f"{BACKEND} does not declare the {CACHE_DTYPE} cache dtype in this vLLM")',
        'if not hasattr(backend, "get_kv_cache_shape"):',
        '    pytest.skip(f"{BACKEND} declares no cache shape in this vLLM (its layouts place the views)")',
        "runnable_writers(monkeypatch)",
        "shape = backend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, CACHE_DTYPE)",
        "kv_cache = torch.zeros(shape, dtype=DTYPE)",
        "before = kv_cache.clone()",
        "generator = torch.Generator().manual_seed(0)",
        "key = torch.rand(1, NUM_KV_HEADS, HEAD_SIZE, generator=generator).add_(1).to(DTYPE)",
        "value = torch.rand(1, NUM_KV_HEADS, HEAD_SIZE, generator=generator).add_(3).to(DTYPE)",
        "slot_mapping = torch.tensor([BLOCK * BLOCK_SIZE + POSITION])",
        "",
        "# The rule (kvfuzz contract): a cache dtype the backend declares is one its cache write takes; the token's K and",
        "# V values land in the cache, inside its block, and no other byte changes.",
        "impl_of(backend).do_kv_cache_update(Layer(), key, value, kv_cache, slot_mapping)",
        "changed = (kv_cache != before).nonzero()",
        "stored = sorted(kv_cache[tuple(changed.T)].float().tolist())",
        "assert stored == sorted(torch.cat([key.flatten(), value.flatten()]).float().tolist()), "
        '"the cache does not hold exactly the token\'s K and V values"',
        "block_axes = [axis for axis, size in enumerate(shape) if size == NUM_BLOCKS]",
        "if len(block_axes) == 1:",
        '    assert set(changed[:, block_axes[0]].tolist()) == {BLOCK}, "the token was written outside its block"'])
    name = f"test_{group.backend.lower()}_cache_write_takes_{spec.cache_dtype}_which_it_declares"
    module.add(f"def {name}(monkeypatch):\n{indent(body)}")
    return module
