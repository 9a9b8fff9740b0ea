"""The training-time test (TTT): the draft is unrolled n steps on its own outputs, as at inference.

Index t of a sequence holds the target's features f_t (from tokens <= t). Step 0 reads (f_t, x_{t+1}) at
RoPE position t and predicts x_{t+2}; step i reads (h^{i-1}_t, x_{t+1+i}) at position t + i, where h^{i-1}_t
is the draft's own output of the previous step at the same index, and predicts x_{t+2+i}. That is what
draft step i sees when decoding: the committed prefix (true features) plus its own earlier steps. So at
step i a query at index t attends to
    step-0 keys at indices <= t  (causal)   and   step-j keys (1 <= j <= i) at index t only (diagonal).
`ttt_mask` builds that pattern; tests/test_ttt.py checks it against a brute-force construction.

The loss at step i is the soft cross-entropy between the draft's distribution over the draft vocab and
the target's softmax restricted to the draft vocab at position t+1+i, counted where x_{t+2+i} is an
assistant token and the target's argmax lies inside the draft vocab; steps are weighted 0.8^i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle3.draft import Eagle3Draft


def ttt_mask(T: int, step: int, device=None) -> Tensor:
    """Bool [T, (step+1)*T]: which keys (step-major: all step-0 keys, then step-1 keys, ...) index t sees."""
    blocks = [torch.ones(T, T, dtype=torch.bool, device=device).tril()]
    eye = torch.eye(T, dtype=torch.bool, device=device)
    blocks += [eye] * step
    return torch.cat(blocks, dim=1)


@dataclass
class TTTBatch:
    input_ids: Tensor  # [B, T] long
    loss_mask: Tensor  # [B, T] 1 on assistant tokens
    features: Tensor  # [B, T, n*H] target hidden states entering the feature layers
    target_logits: Tensor  # [B, T, V'] target logits over the draft vocab (position t predicts x_{t+1})
    target_in_vocab: Tensor  # [B, T] bool: the target's full-vocab argmax at t is inside the draft vocab
    attention_valid: Tensor | None = None  # [B, T] bool, False on right padding


def target_draft_logits(
    final_hidden: Tensor, lm_head_weight: Tensor, draft: Eagle3Draft
) -> tuple[Tensor, Tensor]:
    """From the target's final (normed) hidden states: logits over the draft vocab [.., V'] and whether the
    full-vocab argmax is inside the draft vocab [..]."""
    full = final_hidden.float() @ lm_head_weight.float().T  # [.., V]
    in_vocab = draft.t2d[full.argmax(-1)]
    return full[..., draft.draft_to_target_ids], in_vocab


def ttt_unroll(
    draft: Eagle3Draft,
    embed: torch.nn.Embedding,
    input_ids: Tensor,
    features: Tensor,
    steps: int,
    attention_valid: Tensor | None = None,
    hidden: bool = False,
    start: int = 0,
):
    """Yield (step i, draft logits [B, T - start, V']) for i = 0..steps-1; row j of step i is index
    t = start + j and predicts x_{t+2+i}. hidden=True yields the draft's output states [B, T - start, H]
    instead (`draft.logits` of them are the logits), so a caller can score only the positions that count.
    start > 0 computes only the indices from `start` on (a prompt's cycles start at its last token): step 0
    still reads the keys of every index, the later steps see their own index only, so those rows are what
    start = 0 gives them (up to the matmuls' summation order)."""
    B, T = input_ids.shape
    dev = input_ids.device
    h = draft.project(features)  # [B, T, H]
    pos = torch.arange(start, T, device=dev)[None].expand(B, T - start)
    attn = draft.midlayer.self_attn
    keys, values = [], []
    causal = ttt_mask(T, 0, dev)[None, None, start:]  # [1, 1, T - start, T]
    if attention_valid is not None:  # right padding: never attend to padded keys
        causal = causal & attention_valid[:, None, None, :]
    for i in range(min(steps, T - 1)):
        tok = F.pad(input_ids[:, 1 + i :], (0, 1 + i), value=0)  # x_{t+1+i} at index t (0 past the end)
        if i == 0:  # every index's keys, the queries from `start` on
            cos, sin = draft.rope(torch.arange(T, device=dev)[None].expand(B, T))
            q, k, v = attn.qkv(draft.attn_input(embed(tok), h), cos, sin)
            q, h = q[:, :, start:], h[:, start:]
        else:
            cos, sin = draft.rope(pos + i)
            q, k, v = attn.qkv(draft.attn_input(embed(tok[:, start:]), h), cos, sin)
        keys.append(k)
        values.append(v)
        o = ttt_attention(q, keys, values, causal)  # [B, Hq, T - start, D]
        h = draft.finish(h, attn.o_proj(o.transpose(1, 2).reshape(B, T - start, -1)))
        yield i, (h if hidden else draft.logits(h).float())


def ttt_attention(q: Tensor, keys: list[Tensor], values: list[Tensor], causal: Tensor) -> Tensor:
    """Attention with the `ttt_mask` pattern without materialising it: step-0 keys under the causal mask
    `causal` [B or 1, 1, N, T], and the keys of steps 1..i on the diagonal only, whose scores are a
    per-position dot product. Same result as masked attention over all (i+1)*T keys, in ~1/(i+1) the work.
    q [B, Hq, N, D] (the last N of T indices); keys/values: step 0 [B, Hkv, T, D], later steps
    [B, Hkv, N, D]."""
    G = q.shape[1] // keys[0].shape[1]
    scale = q.shape[-1] ** -0.5
    k0, v0 = keys[0].repeat_interleave(G, 1), values[0].repeat_interleave(G, 1)
    s0 = (q @ k0.transpose(-1, -2)).float() * scale  # [B, Hq, T, T]
    s0 = s0.masked_fill(~causal, float("-inf"))
    diag = [(q * kj.repeat_interleave(G, 1)).sum(-1, keepdim=True).float() * scale for kj in keys[1:]]
    p = torch.cat([s0, *diag], dim=-1).softmax(-1)  # [B, Hq, T, T + i]
    T = s0.shape[-1]
    o = p[..., :T].to(v0.dtype) @ v0
    for j, vj in enumerate(values[1:]):
        o = o + p[..., T + j : T + j + 1].to(vj.dtype) * vj.repeat_interleave(G, 1)
    return o


def ttt_loss(
    draft: Eagle3Draft,
    embed: torch.nn.Embedding,
    batch: TTTBatch,
    steps: int = 7,
    decay: float = 0.8,
) -> tuple[Tensor, dict]:
    """Unrolled loss. Returns (loss, stats) with per-step loss, top-1 agreement (acceptance proxy), counts."""
    target_p = F.softmax(batch.target_logits.float(), dim=-1)  # [B, T, V']
    target_top = batch.target_logits.argmax(-1)  # [B, T] draft ids
    T = target_top.shape[1]
    total = target_p.new_zeros(())
    stats = {"loss": [], "acc": [], "count": []}
    for i, logits in ttt_unroll(draft, embed, batch.input_ids, batch.features, steps, batch.attention_valid):
        # the target at position t+1+i predicts x_{t+2+i}: valid where that token exists and is the assistant's
        tp = F.pad(target_p[:, 1 + i :], (0, 0, 0, 1 + i))
        ttop = F.pad(target_top[:, 1 + i :], (0, 1 + i))
        valid = F.pad(
            batch.loss_mask[:, 2 + i :].bool() & batch.target_in_vocab[:, 1 + i : T - 1], (0, 2 + i)
        )
        n = valid.sum()
        ce = -(tp * F.log_softmax(logits, dim=-1)).sum(-1)  # [B, T]
        loss_i = (ce * valid).sum() / n.clamp(min=1)
        total = total + decay**i * loss_i
        with torch.no_grad():
            acc = ((logits.argmax(-1) == ttop) & valid).sum() / n.clamp(min=1)
        stats["loss"].append(loss_i.detach())
        stats["acc"].append(acc)
        stats["count"].append(n)
    return total, stats
