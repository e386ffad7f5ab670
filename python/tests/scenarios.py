"""GPU scenarios of miles_memory_saver, one per process: `python scenarios.py NAME` with
MILES_TMS_HOOK_MODE=torch|preload (preload: the library in LD_PRELOAD). Exit 0 on success,
77 with a line saying why for a scenario that does not apply, anything else on failure.

Each is written as a torch_memory_saver user writes it; only the import differs.
"""

import glob
import os
import sys
import tempfile

import miles_memory_saver as torch_memory_saver
from miles_memory_saver import MemorySaverError

GIB = 1 << 30
MIB = 1 << 20
SKIP = 77

# Set by main(): importing this module (test_gpu.py does, for the names) needs no PyTorch.
torch = None
saver = torch_memory_saver.torch_memory_saver


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def nvml_used():
    """Used device memory by NVML, or None without nvidia-ml-py."""
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    return pynvml.nvmlDeviceGetMemoryInfo(handle).used


def random_tensor(shape, dtype, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype, device="cuda", generator=generator)
    return torch.randint(0, 255, shape, dtype=dtype, device="cuda", generator=generator)


def assert_same(name, got, want):
    if not torch.equal(got, want):
        diff = (got.double() - want.double()).abs().max().item()
        raise AssertionError(f"{name}: differs, largest difference {diff}")


def pause_frees_and_resume_restores():
    with saver.region(tag="weights", enable_cpu_backup=True):
        x = random_tensor((GIB,), torch.uint8, 1)
    reference = x.cpu()
    before, used_before = free_bytes(), nvml_used()
    saver.pause("weights")
    freed = free_bytes() - before
    assert freed >= 0.995 * GIB, f"pause freed {freed} of {GIB} bytes (mem_get_info)"
    if used_before is not None:
        dropped = used_before - nvml_used()
        assert dropped >= 0.995 * GIB, f"pause freed {dropped} of {GIB} bytes (NVML)"
    saver.resume("weights")
    back = before - free_bytes()
    assert abs(back) <= 64 * MIB, f"resume left free memory {back} bytes off"
    assert_same("weights", x.cpu(), reference)


def cpu_backup_is_bit_exact():
    tensors = {}
    with saver.region(tag="weights", enable_cpu_backup=True):
        tensors["bf16"] = random_tensor((32 * MIB,), torch.bfloat16, 2)
        tensors["f32-odd"] = random_tensor((3_000_001,), torch.float32, 3)
        tensors["u8-one"] = random_tensor((1,), torch.uint8, 4)
    references = {name: t.cpu() for name, t in tensors.items()}
    addresses = {name: t.data_ptr() for name, t in tensors.items()}
    assert saver.get_cpu_backup(tensors["bf16"]) is None, "no backup while active"
    for cycle in range(3):
        saver.pause("weights")
        assert_same(f"cycle {cycle} backup", saver.get_cpu_backup(tensors["f32-odd"]),
                    references["f32-odd"])
        saver.resume("weights")
        for name, tensor in tensors.items():
            assert tensor.data_ptr() == addresses[name], f"{name} moved"
            assert_same(f"cycle {cycle} {name}", tensor.cpu(), references[name])


def disk_backup_is_bit_exact():
    directory = tempfile.mkdtemp(prefix="miles-tms-disk-")
    saver.set_disk_backup_dir(directory)
    with saver.region(tag="optimizer", enable_disk_backup=True):
        tensors = [random_tensor((n,), torch.float32, 10 + n % 7) for n in (17 * MIB + 3, 5)]
    references = [t.cpu() for t in tensors]
    for cycle in range(2):
        before = free_bytes()
        saver.pause("optimizer")
        assert free_bytes() - before >= 64 * MIB, "the disk pause frees the memory"
        assert glob.glob(f"{directory}/**/data.bin", recursive=True), "backup files exist"
        saver.resume("optimizer")
        assert not glob.glob(f"{directory}/**/data.bin", recursive=True), "files removed"
        for index, (tensor, reference) in enumerate(zip(tensors, references)):
            assert_same(f"cycle {cycle} tensor {index}", tensor.cpu(), reference)


def disk_checksum_mismatch_raises():
    directory = tempfile.mkdtemp(prefix="miles-tms-crc-")
    saver.set_disk_backup_dir(directory)
    with saver.region(tag="optimizer", enable_disk_backup=True):
        x = random_tensor((8 * MIB,), torch.float32, 20)
    reference = x.cpu()
    saver.pause("optimizer")
    (path,) = glob.glob(f"{directory}/**/data.bin", recursive=True)
    with open(path, "r+b") as file:
        file.seek(5 * MIB + 11)
        byte = file.read(1)
        file.seek(5 * MIB + 11)
        file.write(bytes([byte[0] ^ 0x10]))
    try:
        saver.resume("optimizer")
    except MemorySaverError as error:
        assert "checksum" in str(error), str(error)
    else:
        raise AssertionError("a corrupted chunk resumed without an error")
    with open(path, "r+b") as file:
        file.seek(5 * MIB + 11)
        file.write(byte)
    saver.resume("optimizer")
    assert_same("after the repaired file", x.cpu(), reference)


def nested_regions():
    with saver.region(tag="outer", enable_cpu_backup=True):
        a = random_tensor((16 * MIB,), torch.float32, 30)
        with saver.region(tag="inner", enable_cpu_backup=True):
            b = random_tensor((16 * MIB,), torch.float32, 31)
        c = random_tensor((16 * MIB,), torch.float32, 32)
    refs = [t.cpu() for t in (a, b, c)]
    lib = saver._library()
    assert lib.tms_get_current_tag() == b"default", "the tag is restored after the regions"
    assert not lib.tms_get_interesting_region()
    before = free_bytes()
    saver.pause("inner")
    freed = free_bytes() - before
    assert 64 * MIB <= freed < 96 * MIB, f"pausing inner freed {freed} bytes: only b's"
    assert_same("a while inner is paused", a.cpu(), refs[0])
    assert_same("c while inner is paused", c.cpu(), refs[2])
    saver.pause("outer")
    saver.resume("inner")
    assert_same("b while outer is paused", b.cpu(), refs[1])
    saver.resume("outer")
    for name, t, ref in zip("abc", (a, b, c), refs):
        assert_same(name, t.cpu(), ref)


def cuda_graph_replays_after_a_cycle():
    if saver.hook_mode != "preload":
        print("pauseable CUDA graphs need hook_mode='preload', as in torch_memory_saver")
        sys.exit(SKIP)
    with saver.region(tag="weights", enable_cpu_backup=True):
        w = random_tensor((1024, 1024), torch.float32, 40)
        static_in = random_tensor((64, 1024), torch.float32, 41)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            torch.relu(static_in @ w) @ w.T
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # Capture on the warmed-up stream: its cuBLAS handle and workspace exist already, outside
    # every tag (a handle made inside the tag would lose its memory to the pause).
    with saver.cuda_graph(graph, stream=side, tag="cuda_graph"):
        out = torch.relu(static_in @ w) @ w.T
    graph.replay()
    reference = out.clone()
    address = out.data_ptr()
    before = free_bytes()
    saver.pause("cuda_graph")
    saver.pause("weights")
    assert free_bytes() > before, "the graph's and the weights' memory is freed"
    saver.resume("weights")
    saver.resume("cuda_graph")
    assert out.data_ptr() == address
    graph.replay()
    assert_same("graph output after the cycle", out, reference)


def rl_weights_and_kv_cache_give_the_same_logits():
    try:
        import transformers
    except ImportError:
        print("transformers is not installed")
        sys.exit(SKIP)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    with saver.region(tag="weights", enable_cpu_backup=True):
        model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 1024, (4, 64), device="cuda")
    with torch.no_grad():
        model(ids[:1, :8])  # library handles and workspaces come to exist outside every tag
    with saver.region(tag="kv_cache"):
        kv_pool = torch.empty((64 * MIB,), dtype=torch.uint8, device="cuda")
        with torch.no_grad():
            first = model(ids, use_cache=True)
    logits = first.logits.clone()
    kv_address = kv_pool.data_ptr()
    del first
    before = free_bytes()
    saver.pause("kv_cache")
    saver.pause("weights")
    freed = free_bytes() - before
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert freed >= weight_bytes + 64 * MIB, f"freed {freed}, weights {weight_bytes}"
    saver.resume("weights")
    saver.resume("kv_cache")
    assert kv_pool.data_ptr() == kv_address
    with saver.region(tag="kv_cache"):
        with torch.no_grad():
            again = model(ids, use_cache=True).logits
    assert_same("logits after the cycle", again, logits)


def training_step_with_tagged_optimizer_state_matches():
    def make():
        torch.manual_seed(1)
        return torch.nn.Sequential(
            torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512)
        ).cuda()

    with saver.region(tag="params", enable_cpu_backup=True):
        cycled = make()
    plain = make()
    opt_cycled = torch.optim.AdamW(cycled.parameters(), lr=1e-3)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    data = torch.Generator(device="cuda").manual_seed(2)
    for step in range(4):
        x = torch.randn((32, 512), device="cuda", generator=data)
        y = torch.randn((32, 512), device="cuda", generator=data)
        for model, optimizer, tagged in ((cycled, opt_cycled, True), (plain, opt_plain, False)):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            if tagged:
                with saver.region(tag="optimizer", enable_cpu_backup=True):
                    optimizer.step()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        saver.pause("optimizer")
        saver.pause("params")
        saver.resume("params")
        saver.resume("optimizer")
    for (name, a), b in zip(cycled.named_parameters(), plain.parameters()):
        assert_same(f"parameter {name} after 4 steps", a, b)
    state = opt_cycled.state[next(cycled.parameters())]
    assert_same("adam moment", state["exp_avg"], opt_plain.state[next(plain.parameters())]["exp_avg"])


def memory_margin_refuses_allocation_and_resume():
    free = free_bytes()
    saver.memory_margin_bytes = free + GIB
    try:
        with saver.region(tag="kv_cache"):
            torch.empty((64 * MIB,), dtype=torch.uint8, device="cuda")
    except (torch.OutOfMemoryError, RuntimeError) as error:
        message = str(error)
    else:
        raise AssertionError("an allocation past the margin succeeded")
    print(f"refused as expected: {message[:200]}")
    saver.memory_margin_bytes = 0
    with saver.region(tag="weights", enable_cpu_backup=True):
        x = random_tensor((256 * MIB,), torch.uint8, 50)
    reference = x.cpu()
    saver.pause("weights")
    paused_free = free_bytes()
    saver.memory_margin_bytes = paused_free
    try:
        saver.resume("weights")
    except MemorySaverError as error:
        assert "cannot resume" in str(error), str(error)
    else:
        raise AssertionError("a resume past the margin succeeded")
    assert abs(free_bytes() - paused_free) <= 8 * MIB, "the refused resume took no memory"
    assert_same("backup while refused", saver.get_cpu_backup(x), reference)
    saver.memory_margin_bytes = 0
    saver.resume("weights")
    assert_same("after the resume", x.cpu(), reference)


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def hundred_cycles_grow_nothing():
    with saver.region(tag="weights", enable_cpu_backup=True):
        w = random_tensor((256 * MIB,), torch.uint8, 60)
    with saver.region(tag="kv_cache"):
        torch.empty((256 * MIB,), dtype=torch.uint8, device="cuda")
    reference = w.cpu()

    def cycle():
        saver.pause()
        saver.resume()

    for _ in range(5):
        cycle()
    rss, free = rss_bytes(), free_bytes()
    for _ in range(100):
        cycle()
    rss_growth, free_drop = rss_bytes() - rss, free - free_bytes()
    assert rss_growth < 64 * MIB, f"host RSS grew {rss_growth} bytes over 100 cycles"
    assert free_drop < 16 * MIB, f"free device memory dropped {free_drop} bytes"
    assert_same("after 105 cycles", w.cpu(), reference)


SCENARIOS = {
    f.__name__: f
    for f in (
        pause_frees_and_resume_restores,
        cpu_backup_is_bit_exact,
        disk_backup_is_bit_exact,
        disk_checksum_mismatch_raises,
        nested_regions,
        cuda_graph_replays_after_a_cycle,
        rl_weights_and_kv_cache_give_the_same_logits,
        training_step_with_tagged_optimizer_state_matches,
        memory_margin_refuses_allocation_and_resume,
        hundred_cycles_grow_nothing,
    )
}


def main():
    global torch
    import torch

    saver.hook_mode = os.environ.get("MILES_TMS_HOOK_MODE", "torch")
    SCENARIOS[sys.argv[1]]()
    print(f"{sys.argv[1]} ({saver.hook_mode}): ok")


if __name__ == "__main__":
    main()
