"""The MTP (NextN) layer: loads beside a transformers checkpoint and matches a dense formulation."""

import torch
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

from model_workers.checkpoint.loader import load_model
from model_workers.runner import ExtendItem, ModelRunner


def dense_mtp_reference(folder, mtp: dict, n: int, next_ids: list[int], prev_hidden: torch.Tensor) -> torch.Tensor:
    """h' = eh_proj([enorm(embed(t_{i+1})) ‖ hnorm(h_i)]), then a one-layer transformers model whose layer 0
    holds the MTP decoder weights (its indexer included) and whose final norm is shared_head.norm."""
    base = DeepseekV32ForCausalLM.from_pretrained(folder).eval()
    cfg = base.config.to_dict()
    cfg.update(num_hidden_layers=1, mlp_layer_types=["sparse"], layer_types=None)
    one_layer = DeepseekV32ForCausalLM(DeepseekV32Config(**{k: v for k, v in cfg.items() if k in DeepseekV32Config.__dataclass_fields__})).eval()
    state = {"model.embed_tokens.weight": base.model.embed_tokens.weight, "lm_head.weight": base.lm_head.weight,
             "model.norm.weight": mtp[f"model.layers.{n}.shared_head.norm.weight"]}
    prefix = f"model.layers.{n}."
    experts = {}
    for name, value in mtp.items():
        rest = name[len(prefix):]
        if rest.startswith("mlp.experts."):
            _, _, e, proj, _ = rest.split(".")
            experts.setdefault(proj, {})[int(e)] = value
        elif not rest.startswith(("enorm", "hnorm", "eh_proj", "shared_head")):
            state["model.layers.0." + rest] = value
    state["model.layers.0.mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([experts["gate_proj"][e], experts["up_proj"][e]]) for e in sorted(experts["gate_proj"])])
    state["model.layers.0.mlp.experts.down_proj"] = torch.stack([experts["down_proj"][e] for e in sorted(experts["down_proj"])])
    missing, unexpected = one_layer.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)

    def rms(x, w, eps=1e-6):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    with torch.no_grad():
        embedded = rms(base.model.embed_tokens(torch.tensor(next_ids)), mtp[f"{prefix}enorm.weight"])
        joined = torch.cat([embedded, rms(prev_hidden, mtp[f"{prefix}hnorm.weight"])], dim=-1)
        h = torch.nn.functional.linear(joined, mtp[f"{prefix}eh_proj.weight"])
        return one_layer(inputs_embeds=h[None]).logits[0]


def test_mtp_checkpoint_loads_in_transformers_and_ours(reference_checkpoint):
    ref, folder = reference_checkpoint("v32", mtp=True)
    reloaded = DeepseekV32ForCausalLM.from_pretrained(folder).eval()  # ignores model.layers.{N}.*
    ids = torch.randint(2, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, ref(ids).logits)
    ours = load_model(folder, progress=False)
    assert ours.num_mtp_layers == 1 and ours.config.num_nextn_predict_layers == 1


def test_mtp_forward_matches_dense_formulation(reference_checkpoint):
    from safetensors.torch import load_file

    _, folder = reference_checkpoint("v32", mtp=True)
    model = load_model(folder, progress=False)
    n = model.config.num_hidden_layers
    mtp = {k: v for k, v in load_file(folder / "model.safetensors").items() if k.startswith(f"model.layers.{n}.")}
    runner = ModelRunner(model, num_pages=16, page_size=8)
    for length in (6, 30):  # shorter than index_topk (dense) and longer (the MTP indexer really selects)
        ids = torch.randint(2, 128, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        (table,) = runner.standalone_tables([length])
        hidden = runner.extend([ExtendItem(table, ids)])  # [L, hidden], final-normed
        sampled = int(model.logits(hidden[-1:]).argmax())
        next_ids = ids[1:] + [sampled]
        mtp_hidden = runner.extend_mtp([ExtendItem(table, next_ids)], hidden, tables_start=[0])
        ours = model.mtp_logits(mtp_hidden)
        expected = dense_mtp_reference(folder, mtp, n, next_ids, hidden)
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
