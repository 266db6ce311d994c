"""One scan from start to end: check the server, plan, send what is missing, summarise, plot."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vllm_chunked_kv.scan.client import EndpointClient
from vllm_chunked_kv.scan.errors import ScanError
from vllm_chunked_kv.scan.placement import Geometry, geometry_from
from vllm_chunked_kv.scan.probes import ProbePlan, build_probes
from vllm_chunked_kv.scan.progress import Progress
from vllm_chunked_kv.scan.records import RecordStore
from vllm_chunked_kv.scan.render import Renderer
from vllm_chunked_kv.scan.report import summarize
from vllm_chunked_kv.scan.runner import FeedbackPoster, RequestSettings, run_probes
from vllm_chunked_kv.scan.tasks import KVTask, UserTask

DEFAULT_HOP = 4


def make_task(args: argparse.Namespace):
    if args.task == "kv":
        return KVTask(args.kv_haystack_len, args.kv_records)
    if args.task == "prose-codes":
        from vllm_chunked_kv.tasks.prose_codes import TASK_FILE

        return UserTask(TASK_FILE)
    return UserTask(args.task)


async def _units(client: EndpointClient, model: str, requested: str) -> str:
    if requested == "chars":
        return "chars"
    if await client.can_tokenize(model):
        return "tokens"
    if requested == "tokens":
        raise ScanError(f"{client.base_url} has no /tokenize route: use --units chars")
    return "chars"


async def _server_layout(client: EndpointClient, args: argparse.Namespace) -> tuple[int, str, Geometry, Geometry]:
    """The hop (--hop, else the server's, else 4); the geometry to place targets by (--window
    overrides the server's) and the one to judge them by (the server's whenever it reports one)."""
    config = await client.server_config() or {}
    served = config.get("phase_hop")
    if args.hop is not None:
        hop, source = args.hop, "--hop"
    elif isinstance(served, int) and served >= 1:
        hop, source = served, "server"
    else:
        hop, source = DEFAULT_HOP, "default"
    chunked = config.get("chunked_kv") if isinstance(config.get("chunked_kv"), dict) else None
    placed = geometry_from(chunked, args.window, hop)
    judged = geometry_from(chunked, None, hop)
    return hop, source, placed, (judged if judged.source == "server" else placed)


async def scan(args: argparse.Namespace) -> dict:
    task = make_task(args)  # a malformed task file fails before any request
    kinds = ["offset", "needle"] if args.probe == "both" else [args.probe]
    max_tokens = args.max_tokens or task.default_max_tokens
    async with EndpointClient(
        args.base_url, api_key=args.api_key, timeout_s=args.timeout, retries=args.retries,
        backoff_s=args.backoff, concurrency=args.concurrency,
    ) as client:
        model = await client.resolve_model(args.model)
        hop, hop_source, geometry, judged = await _server_layout(client, args)
        plan = ProbePlan(
            hop=hop, num_offsets=args.offsets or 2 * hop, prompts=args.prompts, per_phase=args.per_phase,
            seed=args.seed, target_position=args.target_position, needle_range=args.needle_range,
        )
        units = await _units(client, model, args.units)
        settings = {
            "model": model, "task": task.name, "units": units, "hop": plan.hop, "num_offsets": plan.num_offsets,
            "prompts": plan.prompts, "per_phase": plan.per_phase, "seed": plan.seed,
            "target_position": plan.target_position,
            "needle_range": list(plan.needle_range) if plan.needle_range else None,
            "kv_haystack_len": args.kv_haystack_len, "kv_records": args.kv_records,
            "max_tokens": max_tokens, "temperature": args.temperature, "placement": geometry.to_dict(),
        }
        store = RecordStore(args.out)
        store.prepare(settings, fresh=args.fresh)
        renderer = Renderer(client if units == "tokens" else None, model)
        explicit = [x for x in (plan.target_position, plan.needle_range and plan.needle_range[1]) if x is not None]
        await task.place(renderer, geometry, plan.hop, explicit)
        probes = await build_probes(kinds, task, renderer, plan)
        done = store.load()
        pending = [p for p in probes if p.probe_id not in done]
        feedback = FeedbackPoster(client, args.feedback)
        request = RequestSettings(
            model, plan.hop, max_tokens, args.temperature, args.seed if args.temperature > 0 else None
        )
        progress = Progress(len(pending), f"scan {args.probe}", enabled=not args.no_progress)
        try:
            await run_probes(
                client, renderer, task, pending, store, request,
                concurrency=args.concurrency, feedback=feedback, progress=progress,
            )
        except ScanError as exc:
            store.close()
            kept = list(store.load().values())
            store.write_csv(kept)
            answered = len(kept)
            raise ScanError(
                f"{exc}; {answered} answers are kept in {store.jsonl}: re-run the same command to resume"
            ) from None
        finally:
            store.close()
    wanted = {p.probe_id for p in probes}
    records = [r for r in store.load().values() if r.probe_id in wanted]
    store.write_csv(records)
    results = summarize(records, seed=args.seed, geometry=judged.scaled(units))
    out = Path(args.out)
    files = {"records": str(store.jsonl), "csv": str(store.csv), "summary": str(out / "summary.json")}
    if not args.no_plot:
        from vllm_chunked_kv.scan.plot import plot_summary

        files["plot"] = str(plot_summary(results, out / "scan.png", hop=plan.hop, title=f"{model}: {task.name} task"))
    summary = {
        "model": model, "base_url": client.base_url, "units": units, "hop": plan.hop, "hop_source": hop_source,
        "task": task.name, "placement": geometry.scaled(units).to_dict(),
        "resumed": len(done), "sent": len(pending), "feedback": feedback.summary(),
        "settings": settings, "results": results, "files": files,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
