"""How much host time a CUDA graph would take off a verification forward, for a GPU visit.

The engine calls the target once per step on T = k + 1 inputs per row, eagerly, on its `PreallocatedCache`
(attention over the used columns): each kernel launch is the host's work, and at small batches the host sets the
pace. A CUDA graph replays a captured forward with one launch but needs fixed shapes and addresses: `transformers`'
`StaticCache` (every column, written in place at a length kept on the device), with the unused columns masked. Per
batch size this times the verification forward three ways: eager on the engine's cache, eager on a `StaticCache`,
and replayed from a graph captured on it (the step's ids, positions and mask copied into the graph's buffers first);
host milliseconds (until the call returns) beside device milliseconds (CUDA events), and whether all three pick the
same token at every input. On the CPU (the script's test) the graph is left out. The target is `gpu_curve.py`'s.

    PYTHONPATH=src python examples/cuda_graph_verify.py --output bench/qwen3_4b_shape_graph_h100   # CUDA, ~2 min
    python examples/cuda_graph_verify.py --tiny --device cpu --batch-sizes 1 4 --output /tmp/graph
"""

import json
import statistics
import time
from pathlib import Path

import torch
from gpu_curve import QWEN3_4B, TINY, peaked_target, save_figure, visit_arguments
from transformers import DynamicCache, StaticCache

from hf_specformer.generation.cache import PreallocatedCache
from hf_specformer.generation.scheduler import StepClock
from hf_specformer.targets import describe_machine, synchronize


def step_inputs(target, batch_size: int, prompt_length: int, width: int, capacity: int) -> dict:
    """Prompts `[B, P]`, one step's ids and positions `[B, T]`, and its additive mask over all `capacity` columns
    `[B, 1, T, C]` (the prompt and the step's inputs, causal among them; the engine's cache takes its first P + T)."""
    device, dtype, vocab = target.device, target.dtype, target.config.vocab_size
    generator = torch.Generator().manual_seed(batch_size)
    prompt, step = (torch.randint(3, vocab, (batch_size, n), generator=generator).to(device)
                    for n in (prompt_length, width))
    inputs = prompt_length + torch.arange(width, device=device)
    hidden = torch.arange(capacity, device=device)[None, :] > inputs[:, None]  # [T, C]
    mask = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill(hidden, torch.finfo(dtype).min)
    return {"prompt": prompt, "ids": step, "positions": inputs.expand(batch_size, width).contiguous(),
            "mask": mask.expand(batch_size, 1, width, capacity).contiguous()}


def forwards(target, inputs: dict, capacity: int) -> dict:
    """name -> a call running the step's forward on a prefilled cache and rewinding it after (returns the logits)."""
    batch_size, prompt_length = inputs["prompt"].shape
    width, layers = inputs["ids"].shape[1], target.config.num_hidden_layers
    engine_cache = PreallocatedCache.like(DynamicCache(config=target.config), layers, capacity, batch_size)
    static_cache = StaticCache(config=target.config, max_cache_len=capacity)
    for cache in (engine_cache, static_cache):
        target(input_ids=inputs["prompt"], cache=cache, use_cache=True, logits_to_keep=1)

    def engine():
        logits = target(input_ids=inputs["ids"], attention_mask=inputs["mask"][..., : prompt_length + width],
                        position_ids=inputs["positions"], cache=engine_cache, use_cache=True).logits
        engine_cache.crop(-width)
        return logits

    def static(ids=inputs["ids"], positions=inputs["positions"], mask=inputs["mask"]):
        for layer in static_cache.layers:  # rewound first, inside a captured graph too
            layer.cumulative_length.fill_(prompt_length)
        return target(input_ids=ids, attention_mask=mask, position_ids=positions, cache=static_cache,
                      use_cache=True).logits

    calls = {"eager, engine cache": engine, "eager, static cache": static}
    if target.device.type == "cuda":
        try:
            calls["graph, static cache"] = captured(static, inputs)
        except RuntimeError as error:  # something in the forward waits for the host: say what, measure the rest
            print(f"capture failed at B = {batch_size}: {error}", flush=True)
    return calls


def captured(static, inputs: dict):
    """`static` captured in a CUDA graph on buffers of its own; the returned call copies the step's inputs into them
    and replays it."""
    buffers = {name: inputs[name].clone() for name in ("ids", "positions", "mask")}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as capture requires
        for _ in range(3):
            static(**buffers)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = static(**buffers)

    def replay():
        for name, buffer in buffers.items():
            buffer.copy_(inputs[name])
        graph.replay()
        return logits

    return replay


def measure(target, batch_size: int, prompt_length: int, width: int, repeats: int) -> list[dict]:
    """Each way of running one batch size's verification forward, alternated `repeats` times; medians."""
    capacity = prompt_length + 2 * width
    inputs = step_inputs(target, batch_size, prompt_length, width, capacity)
    calls = forwards(target, inputs, capacity)
    clock, tokens = StepClock(target.device), {}
    host, device = ({name: [] for name in calls} for _ in range(2))
    for name, call in calls.items():
        tokens[name] = call().argmax(-1)  # also the warm-up
    for _ in range(repeats):
        for name, call in calls.items():
            synchronize(target.device)
            clock.restart()
            start = time.perf_counter()
            call()
            host[name].append(time.perf_counter() - start)
            clock.end(name)
            synchronize(target.device)
            device[name] += [seconds[0] for _, seconds in clock.read()]
    reference = tokens["eager, engine cache"]
    return [{"batch_size": batch_size, "inputs_per_row": width, "call": name,
             "host_ms": 1000 * statistics.median(host[name]), "device_ms": 1000 * statistics.median(device[name]),
             "same_tokens": bool(torch.equal(tokens[name], reference))} for name in calls]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.5))
    for call in dict.fromkeys(row["call"] for row in rows):
        picked = [row for row in rows if row["call"] == call]
        for field, style in (("host_ms", "-"), ("device_ms", ":")):
            axis.plot([row["batch_size"] for row in picked], [row[field] for row in picked], marker="o",
                      linestyle=style, label=f"{call}: {field[:-3]}")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set(xlabel="batch size", ylabel="ms per verification forward", title="Verification forward: eager vs graph")
    save_figure(figure, axis, path)


def main(argv: list[str] | None = None) -> dict:
    parser = visit_arguments(__doc__.splitlines()[0])
    parser.add_argument("--inputs-per-row", type=int, default=4, help="T = k + 1")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    target = peaked_target(TINY if args.tiny else QWEN3_4B, args.device, dtype)
    report = {"machine": describe_machine(args.device, str(dtype).removeprefix("torch.")), "config": vars(args),
              "results": []}
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        for batch_size in args.batch_sizes:  # the report is rewritten after each: an interrupted visit keeps it
            rows = measure(target, batch_size, args.prompt_length, args.inputs_per_row, args.repeats)
            report["results"] += rows
            output.with_suffix(".json").write_text(json.dumps(report, indent=1))
            plot(report["results"], output.with_suffix(".png"))
            for row in rows:
                print(f"B={batch_size} {row['call']}: host {row['host_ms']:.2f} ms, device {row['device_ms']:.2f} ms, "
                      f"same tokens: {row['same_tokens']}", flush=True)
    return report


if __name__ == "__main__":
    main()
