"""Page tags with an injected fault: mid-run, one request's page-table entry is pointed at another request's
page (the kind of bookkeeping bug that makes a server answer with someone else's context). With tags on (the
engine's default) one batched check before the step catches it: exactly that request is aborted, with the
reason, and every other request's tokens are unchanged. With tags off the request silently reads the wrong
page. Tiny Kimi K2.6-shaped model; CPU in seconds, GPU when present.

    python examples/04b_page_tags_fault.py
"""
import torch

from mla_quant.engine import Engine, SamplingParams, Status
from mla_quant.eval import kl_divergence
from mla_quant.models import KimiK26Config, KimiK26ForCausalLM, init_random_weights_

REQUESTS, PROMPT, NEW, VICTIM = 5, 24, 10, 2


def serve(model, prompts, page_tags: bool, fault: bool):
    engine = Engine(model, num_pages=64, page_size=8, page_tags=page_tags, record_logits=True)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=NEW)) for p in prompts]
    results = {}
    while engine.has_unfinished():
        live = engine.request(ids[VICTIM])
        if fault and live is not None and live.status is Status.DECODE and len(live.output) == 3:
            engine.inject_fault(ids[VICTIM])         # its entry 0 -> another request's page, at the next step
        results.update({r.request_id: r for r in engine.step()})
    return engine, [results[i] for i in ids]


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)     # tiny ops: threads only contend
    model = init_random_weights_(KimiK26ForCausalLM(KimiK26Config.tiny(), dtype=torch.float32, device=device), 0)
    prompts = torch.randint(3, 512, (REQUESTS, PROMPT), generator=torch.Generator().manual_seed(1)).tolist()
    _, clean = serve(model, prompts, page_tags=True, fault=False)
    engine, tagged = serve(model, prompts, page_tags=True, fault=True)
    print(f"{REQUESTS} requests; request {VICTIM}'s page-table entry 0 corrupted after its 3rd token")
    print(f"tags on : {engine.stats.tag_checks} batched checks, {engine.stats.aborts} aborted")
    for i, (c, t) in enumerate(zip(clean, tagged)):
        status = (f"aborted after {len(t.output_ids)} tokens: {t.abort_reason}" if t.finish_reason == "aborted"
                  else f"{len(t.output_ids)} tokens, {'same as' if t.output_ids == c.output_ids else 'DIFFERENT from'}"
                       " the clean run")
        print(f"  request {i}: {status}")
    engine, untagged = serve(model, prompts, page_tags=False, fault=True)
    v, c = untagged[VICTIM], clean[VICTIM]
    n = len(v.output_ids)
    kl = kl_divergence(c.logits[:n].double(), v.logits.double(), "none")
    print(f"tags off: {engine.stats.aborts} aborted; request {VICTIM} finished with "
          f"{'the same' if v.output_ids == c.output_ids else 'different'} tokens; KL of its distributions from the "
          f"clean run's, token by token: {', '.join(f'{x:.3f}' for x in kl.tolist())}")


if __name__ == "__main__":
    main()
