"""The `torchfleet plan` command's flags, and the call from flags to the plan (plan/run.py)."""

from __future__ import annotations

import argparse
import re

from torchfleet.cli.bench import _list
from torchfleet.plan.kernels import ATTENTION, COMPILE_COMPONENTS, DISPATCH

# A bandwidth as people write it: a number with an optional unit. A lower-case b (or "bit") is bits, an upper-case
# B bytes, as on datasheets: 100Gb/s and 400 Gbit/s are network links, 900GB/s is NVLink's bytes.
_BANDWIDTH = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kMGT]?)(bit|bps|b|B)(?:/s|ps)?)?\s*", re.IGNORECASE)
_PREFIX = {"": 1e-9, "k": 1e-6, "m": 1e-3, "g": 1.0, "t": 1e3}  # to giga


def gbit_per_s(flag: str):
    """argparse's type for a bandwidth flag: the value in Gbit/s, from "100", "100Gb/s", "800 Mbit/s" or "900GB/s"."""

    def parse(text: str) -> float:
        found = _BANDWIDTH.fullmatch(text)
        if found is None:
            raise argparse.ArgumentTypeError(
                f"{flag} {text!r} is not a bandwidth; give Gbit/s as a number (100) or with a unit, such as"
                " 100Gb/s, 400Gbit/s, 800Mb/s, or 900GB/s for bytes"
            )
        number, prefix, unit = found.groups()
        if unit is None:  # a bare number is Gbit/s, as the flag's help says
            return float(number)
        scale = _PREFIX[prefix.lower()] if prefix else _PREFIX[""]
        in_bytes = unit[0] == "B" and unit.lower() != "bit"  # MB/s and MBps are bytes; Mbit/s, Mbps bits
        return float(number) * scale * (8 if in_bytes else 1)

    return parse


def add_parser(sub) -> None:
    from torchfleet.plan import library_model
    from torchfleet.plan.hardware import GPUS
    from torchfleet.train.models import GPT_PRESETS, MODELS

    p = sub.add_parser(
        "plan",
        help="predicted memory per rank and step time of every strategy, here or on a described cluster;"
        " --check measures them against bench",
        description="Predicts, for each strategy and number of processes, the memory per rank (parameters,"
        " gradients, optimizer state, activations, communication buffers), whether it fits, the largest batch that"
        " does, and the step time (compute, communication, the pipeline bubble), then recommends one. The model's"
        " own memory and time are measured from a few steps here, and this machine's link from short probes"
        " (cached). Without --nodes/--gpus-per-node/--cpus-per-node the target is this machine.",
    )
    p.add_argument(
        "--model",
        default="cnn",
        metavar="NAME",
        help=f"a built-in model ({', '.join(MODELS)}; default cnn) or MODULE:FUNCTION, as bench takes it",
    )
    p.add_argument("--gpt-preset", choices=tuple(GPT_PRESETS), default="tiny", help="--model gpt's size")
    p.add_argument(
        "--image-size",
        type=int,
        default=224,
        metavar="PIXELS",
        help="--model resnet18/resnet50: images are 3 x PIXELS x PIXELS (default 224)",
    )
    p.add_argument(
        "--batch-size", type=int, default=None, help="the GLOBAL batch (default: bench's first for the model)"
    )
    p.add_argument("--optimizer", default="adamw", help="adamw (default), sgd (with momentum) or sgd-plain")
    p.add_argument(
        "--precision",
        default=None,
        help="fp32 (default), bf16 or fp16: picks a GPU's peak; with --hf-config bf16 (default) or fp32",
    )
    p.add_argument("--strategies", type=_list(str, "strategies"), default=None, help="comma-separated (default: all)")
    p.add_argument(
        "--nproc",
        type=_list(int, "process counts"),
        default=None,
        help="process counts (default 1,2,4 here; powers of two up to the devices of a cluster)",
    )
    p.add_argument(
        "--schedule",
        default=None,
        help="the pipelines' schedule: gpipe, 1f1b, interleaved-1f1b, looped-bfs, interleaved-zb or zbv"
        " (default 1f1b, or interleaved-1f1b with --stages-per-process 2 or more), as train and bench"
        " take it",
    )
    p.add_argument(
        "--stages-per-process",
        type=int,
        default=None,
        help="the pipelines' stages per process (default 1; 2 or more for interleaved-1f1b, looped-bfs"
        " and interleaved-zb, exactly 2 for zbv)",
    )
    s = p.add_argument_group(
        "a library model at scale, traced on fake tensors (never allocated; needs a described GPU cluster)"
    )
    s.add_argument(
        "--hf-config",
        default=None,
        metavar="NAME|PATH",
        help="a Hugging Face config.json, or a shipped one: "
        + ", ".join(library_model.shipped())
        + "; plans FSDP's memory per GPU and step time over the cluster's GPU counts, with tensor"
        " parallelism (--tp), pipelines (--pp) and expert parallelism (--ep)",
    )
    s.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="--hf-config: tokens a sample (default 8192, or the model's own longest where shorter: 512 for"
        " BERT's learned positions and T5's pre-training)",
    )
    s.add_argument(
        "--decoder-seq-len",
        type=int,
        default=None,
        help="--hf-config: tokens an encoder-decoder's decoder writes a sample (default: --seq-len's)",
    )
    s.add_argument(
        "--attention",
        choices=ATTENTION,
        default="fused",
        help="--hf-config: how attention runs: fused kernels that hold no score matrix (FlashAttention-2's; the"
        " default), cuDNN's fused kernel (Transformer Engine's, SDPA's cuDNN backend; Hopper GPUs, priced"
        " faster), or eager's math: its scores materialised and held, the softmax and what else runs on"
        " them priced at the memory's rate, as runs without fused attention trained (docs/tools/plan.md)",
    )
    s.add_argument(
        "--local-batch",
        type=int,
        default=2,
        help="--hf-config: samples a GPU runs at once (default 2); without --global-batch, a step's",
    )
    s.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="--hf-config: samples a step on every row, reached by each layout's data-parallel GPUs with"
        " gradient accumulation (passes of at most --local-batch) or micro-batches (default: --local-batch"
        " a data-parallel GPU, so it grows with them)",
    )
    s.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="--hf-config: micro-batches a pipeline (--pp) splits a GPU's share of the batch into (default:"
        " micro-batches of one sample, torchtitan's default)",
    )
    s.add_argument(
        "--ac",
        default="selective",
        metavar="MODE",
        help="--hf-config: activation checkpointing of each block: none, selective (default; torchtitan's"
        " operator policy) or full",
    )
    s.add_argument(
        "--tp",
        type=_list(int, "tensor-parallel degrees"),
        default=None,
        metavar="DEGREES",
        help="--hf-config: tensor-parallel degrees to plan, comma-separated (default: 1 and a node's GPUs"
        " where they divide the model's heads), FSDP over the rest of the GPUs",
    )
    s.add_argument(
        "--pp",
        type=_list(int, "pipeline degrees"),
        default=None,
        metavar="DEGREES",
        help="--hf-config: pipeline stages to plan as well, comma-separated, each dividing the model's blocks"
        " (micro-batches of one sample; --schedule, default 1f1b and interleaved-1f1b)",
    )
    s.add_argument(
        "--ep",
        type=_list(int, "expert-parallel degrees"),
        default=None,
        metavar="DEGREES",
        help="--hf-config: expert-parallel degrees to plan as fsdp+ep, comma-separated, each dividing the"
        " model's experts (default for a model with experts: the most of a node's GPUs that divide them),"
        " FSDP over every GPU",
    )
    s.add_argument(
        "--ep-dispatch",
        choices=DISPATCH,
        default=DISPATCH[0],
        help="--hf-config: how fsdp+ep's tokens reach their experts: all-to-alls of a row per chosen expert"
        " (torchtitan's; the default), or DeepEP's dispatch and combine, a row per token and GPU that holds"
        " any of its experts",
    )
    s.add_argument(
        "--compile",
        nargs="?",
        const=",".join(COMPILE_COMPONENTS),
        default=(),
        type=_list(str, "compiled components"),
        metavar="COMPONENTS",
        help="--hf-config: plan torch.compile's step, as torchtitan's compile.components names what it compiles:"
        f" {', '.join(COMPILE_COMPONENTS)} (the default when the flag is bare). Pointwise operators fused, so"
        " each only writes its output; each fused chain holds its inputs, not its links (docs/tools/plan.md)",
    )
    s.add_argument(
        "--float8",
        action="store_true",
        help="--hf-config: plan float8 linear layers (torchao, tensorwise): products on the FP8 tensor cores, their"
        " operands cast first; H100, H200 and L40S kinds",
    )
    c = p.add_argument_group("a described cluster (instead of this machine)")
    c.add_argument("--nodes", type=int, default=None, help="machines")
    c.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per machine, a process each")
    c.add_argument(
        "--cpus-per-node",
        type=int,
        default=None,
        help="CPU cores per machine, a process each, at the rates measured here",
    )
    c.add_argument("--gpu", default=None, help=f"a GPU from the table ({', '.join(GPUS)})")
    c.add_argument("--tflops", type=float, default=None, help="one device's dense peak TFLOP/s (for another GPU)")
    c.add_argument("--memory-gb", type=float, default=None, help="one GPU's memory, or one CPU machine's, in GB")
    c.add_argument(
        "--mfu",
        type=float,
        default=None,
        help="the fraction of the GPU's peak achieved (default as measured on an H100: 0.18 in bf16 and"
        " fp16, 0.65 of the plain FP32 peak in fp32, which torch runs without TF32; --hf-config in bf16 on a"
        " GPU of the table: each operator at the rate that bounds it instead, 0.48 elsewhere)",
    )
    c.add_argument(
        "--link",
        type=gbit_per_s("--link"),
        default=None,
        metavar="BANDWIDTH",
        help="bandwidth between machines: Gbit/s, or with a unit (100Gb/s, 400Gbit/s, 800Mb/s, 50GB/s"
        " for bytes; default 100Gb/s)",
    )
    c.add_argument(
        "--intra-link",
        type=gbit_per_s("--intra-link"),
        default=None,
        metavar="BANDWIDTH",
        help="bandwidth between devices of one machine, written as --link's (default NVLink on"
        " H100/H200/A100, PCIe on others, the probed local link on CPUs)",
    )
    o = p.add_argument_group("output and checks")
    o.add_argument("--json-out", default=None, metavar="FILE", help="write the whole plan as JSON")
    o.add_argument(
        "--chart",
        default=None,
        metavar="FILE.png",
        help="draw predicted throughput and memory per rank against processes",
    )
    o.add_argument("--reprobe", action="store_true", help="measure this machine again instead of using the cache")
    o.add_argument(
        "--check",
        action="store_true",
        help="run bench's cells here and print predicted against measured step time and peak memory",
    )
    o.add_argument("--warmup", type=int, default=2, help="--check: untimed steps per cell (default 2)")
    o.add_argument("--steps", type=int, default=5, help="--check: timed steps per cell (default 5)")


def command(args) -> int:
    from rich.console import Console

    from torchfleet.outputs import check_writable_file
    from torchfleet.plan import report
    from torchfleet.plan.config import PlanConfig
    from torchfleet.plan.run import plan_document, run_check

    precision = args.precision or ("bf16" if args.hf_config else "fp32")
    cfg = PlanConfig(
        model=args.model,
        gpt_preset=args.gpt_preset,
        image_size=args.image_size,
        batch=args.batch_size,
        optimizer=args.optimizer,
        precision=precision,
        strategies=args.strategies or (),
        nproc=args.nproc or (),
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        cpus_per_node=args.cpus_per_node,
        gpu=args.gpu,
        tflops=args.tflops,
        memory_gb=args.memory_gb,
        mfu=args.mfu,
        link_gbit=args.link,
        intra_gbit=args.intra_link,
        reprobe=args.reprobe,
        json_out=args.json_out,
        chart=args.chart,
        check=args.check,
        warmup=args.warmup,
        steps=args.steps,
        schedule=args.schedule,
        stages_per_process=args.stages_per_process,
        hf_config=args.hf_config,
        seq_len=args.seq_len,
        decoder_seq_len=args.decoder_seq_len,
        attention=args.attention,
        ep_dispatch=args.ep_dispatch,
        local_batch=args.local_batch,
        ac=args.ac,
        tp=args.tp or (),
        pp=args.pp or (),
        ep=args.ep or (),
        global_batch=args.global_batch,
        microbatches=args.microbatches,
        compile=tuple(args.compile or ()),
        float8=args.float8,
    )
    if cfg.library_fields and not args.precision:
        cfg.precision = "bf16"  # a --model builder's library model is planned at scale, as --hf-config's
    for path, what in ((cfg.json_out, "--json-out"), (cfg.chart, "--chart")):
        if path:
            check_writable_file(path, what)
    console = Console(width=None if Console().is_terminal else 160)

    def say(text: str) -> None:
        console.print(text, markup=False, highlight=False)

    if cfg.hf_config or cfg.library_fields:  # a library model at scale, from its config or its --model builder
        return _at_scale(cfg, console, say)
    document = plan_document(cfg, say=say)
    for note in document["notes"]:
        say(f"note: {note}")
    console.print(report.table(document))
    for sentence in document["recommendation"]["sentences"].values():
        say(f"- {sentence}")
    if cfg.check:
        document["check"] = run_check(cfg, document, say=say)
        console.print(report.check_table(document["check"]))
        for sentence in report.check_sentences(document["check"]["summary"]):
            say(f"check: {sentence}")
    if cfg.json_out:
        report.write_json(document, cfg.json_out)
        say(f"wrote {cfg.json_out}")
    if cfg.chart:
        say(f"chart: {report.chart(document, cfg.chart)}")
    return 0


def _at_scale(cfg, console, say) -> int:
    from torchfleet.plan import at_scale, report

    document = at_scale.plan_at_scale(at_scale.request_of(cfg), say=say)
    for note in document["notes"]:
        say(f"note: {note}")
    console.print(at_scale.table(document))
    say(f"- {document['recommendation']}")
    if cfg.json_out:
        report.write_json(document, cfg.json_out)
        say(f"wrote {cfg.json_out}")
    return 0
