"""One scan from start to end: check the servers, plan, send what is missing, summarise, plot.

With `--compare-url` every probe also goes to a second endpoint (B), whose
records live under `--out`/compare; the summary then carries B's results
and the paired comparison (`compare.py`).
"""

from __future__ import annotations

import argparse
import json
from contextlib import AsyncExitStack
from pathlib import Path

from vllm_chunked_kv.scan.client import EndpointClient
from vllm_chunked_kv.scan.compare import compare_records
from vllm_chunked_kv.scan.errors import ScanError
from vllm_chunked_kv.scan.probes import ProbePlan, build_probes, probe_kinds
from vllm_chunked_kv.scan.progress import Progress
from vllm_chunked_kv.scan.records import RecordStore
from vllm_chunked_kv.scan.render import Renderer
from vllm_chunked_kv.scan.report import summarize
from vllm_chunked_kv.scan.runner import Endpoint, FeedbackPoster, RequestSettings, run_jobs
from vllm_chunked_kv.scan.server_layout import check_same_tokenizer, scan_units, server_layout
from vllm_chunked_kv.scan.tasks import KVTask, UserTask


def make_task(args: argparse.Namespace):
    if args.task == "kv":
        return KVTask(args.kv_haystack_len, args.kv_records)
    if args.task == "prose-codes":
        from vllm_chunked_kv.tasks.prose_codes import TASK_FILE

        return UserTask(TASK_FILE)
    return UserTask(args.task)


def _client(args: argparse.Namespace, url: str) -> EndpointClient:
    return EndpointClient(
        url, api_key=args.api_key, timeout_s=args.timeout, retries=args.retries,
        backoff_s=args.backoff, concurrency=args.concurrency,
    )


def _stores(args: argparse.Namespace, count: int) -> list[RecordStore]:
    return [RecordStore(args.out), RecordStore(Path(args.out) / "compare")][:count]


async def scan(args: argparse.Namespace) -> dict:
    task = make_task(args)  # a malformed task file fails before any request
    kinds = probe_kinds(args.probe)
    max_tokens = args.max_tokens or task.default_max_tokens
    urls = [args.base_url] + ([args.compare_url] if getattr(args, "compare_url", None) else [])
    async with AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(_client(args, url)) for url in urls]
        models = [await clients[0].resolve_model(args.model)]
        models += [await c.resolve_model(getattr(args, "compare_model", None)) for c in clients[1:]]
        layout = server_layout([await c.server_config() or {} for c in clients], args.hop, args.window)
        plan = ProbePlan(
            hop=layout.hop, num_offsets=args.offsets or 2 * layout.hop, prompts=args.prompts,
            per_phase=args.per_phase, seed=args.seed, target_position=args.target_position,
            needle_range=args.needle_range,
        )
        units = await scan_units(clients[0], models[0], args.units)
        if len(clients) > 1 and units == "tokens":
            await check_same_tokenizer(clients[0], models[0], clients[1], models[1])
        settings = {
            "model": models[0], "task": task.name, "units": units, "hop": plan.hop, "num_offsets": plan.num_offsets,
            "prompts": plan.prompts, "per_phase": plan.per_phase, "seed": plan.seed, "probes": kinds,
            "target_position": plan.target_position,
            "needle_range": list(plan.needle_range) if plan.needle_range else None,
            "kv_haystack_len": args.kv_haystack_len, "kv_records": args.kv_records,
            "max_tokens": max_tokens, "temperature": args.temperature, "placement": layout.placed.to_dict(),
        }
        stores = _stores(args, len(clients))
        for store, model in zip(stores, models):
            store.prepare({**settings, "model": model}, fresh=args.fresh)
        renderer = Renderer(clients[0] if units == "tokens" else None, models[0])
        explicit = [x for x in (plan.target_position, plan.needle_range and plan.needle_range[1]) if x is not None]
        await task.place(renderer, layout.placed, plan.hop, explicit)
        probes = await build_probes(kinds, task, renderer, plan)
        done = [store.load() for store in stores]
        endpoints = [
            Endpoint(client, store, RequestSettings(model, plan.hop, max_tokens, args.temperature,
                                                    args.seed if args.temperature > 0 else None),
                     FeedbackPoster(client, args.feedback))
            for client, store, model in zip(clients, stores, models)
        ]
        jobs = [(e, p) for p in probes for e, d in zip(endpoints, done) if p.probe_id not in d]
        progress = Progress(len(jobs), f"scan {args.probe}", enabled=not args.no_progress)
        try:
            await run_jobs(jobs, renderer, task, concurrency=args.concurrency, progress=progress)
        except ScanError as exc:
            answered = _close(stores)
            raise ScanError(
                f"{exc}; {answered} answers are kept in {stores[0].jsonl}: re-run the same command to resume"
            ) from None
        finally:
            for store in stores:
                store.close()
    wanted = {p.probe_id for p in probes}
    records = [[r for r in store.load().values() if r.probe_id in wanted] for store in stores]
    for store, mine in zip(stores, records):
        store.write_csv(mine)
    results = [
        summarize(mine, hop=plan.hop, seed=args.seed, geometry=geometry.scaled(units))
        for mine, geometry in zip(records, layout.judged)
    ]
    out = Path(args.out)
    files = {"records": str(stores[0].jsonl), "csv": str(stores[0].csv), "summary": str(out / "summary.json")}
    summary = {
        "model": models[0], "base_url": clients[0].base_url, "units": units, "hop": plan.hop,
        "hop_source": layout.hop_source, "task": task.name, "placement": layout.placed.scaled(units).to_dict(),
        "resumed": len(done[0]), "sent": sum(e is endpoints[0] for e, _ in jobs),
        "feedback": endpoints[0].feedback.summary(), "settings": settings, "results": results[0], "files": files,
    }
    if len(clients) > 1:
        summary["compare"] = {
            "model": models[1], "base_url": clients[1].base_url, "resumed": len(done[1]),
            "sent": sum(e is endpoints[1] for e, _ in jobs), "feedback": endpoints[1].feedback.summary(),
            "records": str(stores[1].jsonl), "results": results[1],
            "paired": compare_records(records[0], records[1], plan.hop),
        }
    if not args.no_plot:
        from vllm_chunked_kv.scan.plot import plot_summary

        names = tuple(f"{x}: {c.base_url}" for x, c in zip("AB", clients)) + ("",)
        files["plot"] = str(plot_summary(
            results[0], out / "scan.png", hop=plan.hop, title=f"{models[0]}: {task.name} task",
            other=results[1] if len(results) > 1 else None, names=names[:2],
        ))
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _close(stores: list[RecordStore]) -> int:
    """Close every store, write its CSV; the answers the first (A) holds."""
    kept = []
    for store in stores:
        store.close()
        mine = list(store.load().values())
        store.write_csv(mine)
        kept.append(len(mine))
    return kept[0]
