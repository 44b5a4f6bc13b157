"""The refinement predictor (DWISE): a discrete-time survival model on the
first denoising round's pooled final-layer hidden rows.

Input: the pooled hidden vector with the normalised prompt length, output
budget and threshold, and the confidence statistics of that round's draft
(the logits are a projection of the same rows), all standardised. Each of three seeds' MLPs (two layers,
width 256, GELU, dropout 0.2) gives one hazard logit per round 1..K (K: the
largest round count in training); the estimate is the mean of the implied
distribution of total rounds, averaged over the seeds and mapped by an
isotonic fit (training split) onto actual rounds, the scale the admission
predictor targets, so refined and unrefined requests rank consistently.

That learned estimate cannot reach past the longest requests in training (its
hazards end at K, the isotonic map clips). A structural term covers what it has
not seen: the first round's own P(EOS) per output position gives the expected
number of blocks the answer reaches (``features.expected_blocks``; past the
positions a block-causal model sees, the answer runs on to its budget), and
every expected block beyond the most any training request decoded adds one
round, the least a block takes. Trained with multi-block answers the term is
about zero; trained without them, a request whose first round predicts no end
in its first block still ranks above every single-block one.

``Refiner.hook`` runs inside the engine right after a round's forward, on the
round's device, for every request that just ran its first denoising round;
its result is read with the round's own results (no extra synchronisation).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from predictors.features import confidence_stats, expected_blocks

WIDTH = 256
SEEDS = (0, 1, 2)


class SurvivalMLP(nn.Module):
    def __init__(self, n_in: int, k: int, width: int = WIDTH, dropout: float = 0.2) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_in, width), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(width, width), nn.GELU(), nn.Dropout(dropout), nn.Linear(width, k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def expected_rounds(logits: torch.Tensor) -> torch.Tensor:
    """Mean of T given hazard logits [n, K] for T = 1..K (mass left after K sits at K)."""
    log_h = torch.nn.functional.logsigmoid(logits)
    log_s = torch.nn.functional.logsigmoid(-logits)  # log(1 - h)
    surv_before = torch.cumsum(torch.cat([torch.zeros_like(log_s[:, :1]), log_s[:, :-1]], dim=1), dim=1)
    pmf = torch.exp(surv_before + log_h)
    k = torch.arange(1, logits.shape[1] + 1, dtype=logits.dtype, device=logits.device)
    tail = torch.exp(surv_before[:, -1] + log_s[:, -1])
    return (pmf * k).sum(1) + tail * logits.shape[1]


def survival_nll(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of observed totals t (1..K) under hazard logits."""
    k = torch.arange(1, logits.shape[1] + 1, device=logits.device)
    before = (k[None, :] < t[:, None]).to(logits.dtype)
    at = (k[None, :] == t[:, None]).to(logits.dtype)
    ll = before * torch.nn.functional.logsigmoid(-logits) + at * torch.nn.functional.logsigmoid(logits)
    return -ll.sum(1).mean()


class Refiner:
    def __init__(self, mlps: list[SurvivalMLP], mean: torch.Tensor, std: torch.Tensor, iso_x: np.ndarray,
                 iso_y: np.ndarray, k: int, max_blocks: int | None = None) -> None:
        self.mlps = [m.eval() for m in mlps]
        self.mean, self.std, self.k = mean, std, k
        self.max_blocks = max_blocks  # the most blocks a training request decoded (None: no structural term)
        self.iso_x, self.iso_y = np.asarray(iso_x, dtype=np.float64), np.asarray(iso_y, dtype=np.float64)

    # ---- inputs ----------------------------------------------------------------------------
    @staticmethod
    def inputs(hidden: torch.Tensor, prompt_tokens, budget, threshold, conf_stats) -> torch.Tensor:
        """[n, hidden + 8]: pooled hidden rows, normalised prompt length and output budget, threshold,
        and the first round's confidence statistics (``conf_stats`` [n, 5], see ``features.confidence_stats``)."""
        dev, dt = hidden.device, hidden.dtype
        extra = torch.stack([torch.as_tensor(prompt_tokens, dtype=dt, device=dev) / 512.0,
                             torch.as_tensor(budget, dtype=dt, device=dev) / 1024.0,
                             torch.as_tensor(threshold, dtype=dt, device=dev)], dim=1)
        return torch.cat([hidden, extra, torch.as_tensor(conf_stats, dtype=dt, device=dev).reshape(-1, 5)], dim=1)

    @torch.inference_mode()
    def raw(self, x: torch.Tensor) -> torch.Tensor:
        """Ensemble mean of the survival means, before the isotonic map."""
        z = (x.float() - self.mean.to(x.device)) / self.std.to(x.device)
        return torch.stack([expected_rounds(m.to(x.device)(z)) for m in self.mlps]).mean(0)

    def calibrate(self, raw: np.ndarray) -> np.ndarray:
        return np.interp(np.asarray(raw, dtype=np.float64), self.iso_x, self.iso_y)

    def beyond_training(self, blocks) -> np.ndarray:
        """Rounds the learned estimate cannot know about: one per expected block past the most
        blocks any training request decoded (zero without ``blocks`` or a recorded maximum)."""
        if blocks is None or self.max_blocks is None:
            return np.zeros(1)
        return np.maximum(0.0, np.asarray(blocks, dtype=np.float64) - self.max_blocks)

    def predict(self, hidden, prompt_tokens, budget, threshold, conf_stats, blocks=None) -> np.ndarray:
        """``blocks``: expected blocks per request (``features.expected_blocks``)."""
        x = self.inputs(torch.as_tensor(hidden, dtype=torch.float32), prompt_tokens, budget, threshold, conf_stats)
        return self.calibrate(self.raw(x).cpu().numpy()) + self.beyond_training(blocks)

    def hook(self, seqs) -> None:
        """The engine's refine hook: one batched pass for the round's first-round requests."""
        hidden = torch.stack([s.first_hidden for s in seqs]).float()
        default_t = 0.9
        x = self.inputs(hidden, [len(s.prompt_ids) for s in seqs], [s.max_tokens for s in seqs],
                        [default_t if s.threshold is None else s.threshold for s in seqs],
                        torch.stack([confidence_stats(s.first_confidences) for s in seqs]).to(hidden))
        b = seqs[0].cfg.block_size
        blocks = expected_blocks([s.first_eos for s in seqs], b, [-(-s.max_tokens // b) for s in seqs])
        est = self.calibrate(self.raw(x).tolist()) + self.beyond_training(blocks.tolist())
        for seq, e in zip(seqs, est):
            seq.refined_rounds = float(max(e, seq.rounds))

    # ---- training and files -----------------------------------------------------------------
    @classmethod
    def fit(cls, x: np.ndarray, rounds: np.ndarray, epochs: int = 300, seeds=SEEDS, lr: float = 1e-3,
            blocks: np.ndarray | None = None) -> Refiner:
        """``blocks``: output blocks each training request decoded (enables the structural term)."""
        from sklearn.isotonic import IsotonicRegression

        xt = torch.as_tensor(x, dtype=torch.float32)
        t = torch.as_tensor(rounds, dtype=torch.long)
        k = int(t.max())
        mean, std = xt.mean(0), xt.std(0).clamp_min(1e-6)
        z = (xt - mean) / std
        mlps = []
        for seed in seeds:
            torch.manual_seed(seed)
            mlp = SurvivalMLP(x.shape[1], k)
            opt = torch.optim.AdamW(mlp.parameters(), lr=lr, weight_decay=1e-4)
            gen = torch.Generator().manual_seed(seed)
            for _ in range(epochs):
                for idx in torch.randperm(len(z), generator=gen).split(256):
                    loss = survival_nll(mlp(z[idx]), t[idx])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
            mlps.append(mlp.eval())
        ref = cls(mlps, mean, std, np.array([0.0, 1.0]), np.array([0.0, 1.0]), k,
                  None if blocks is None else int(np.max(blocks)))
        raw = ref.raw(xt).numpy()
        iso = IsotonicRegression(out_of_bounds="clip", y_min=1.0).fit(raw, np.asarray(rounds, dtype=np.float64))
        ref.iso_x, ref.iso_y = np.asarray(iso.X_thresholds_), np.asarray(iso.y_thresholds_)
        return ref

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        tensors = {f"mlp{i}.{k}": v.contiguous() for i, m in enumerate(self.mlps) for k, v in m.state_dict().items()}
        tensors.update(mean=self.mean, std=self.std, iso_x=torch.as_tensor(self.iso_x),
                       iso_y=torch.as_tensor(self.iso_y))
        save_file(tensors, str(path), metadata={"config": json.dumps({"k": self.k, "n_in": int(self.mean.numel()),
                                                                       "seeds": len(self.mlps), "width": WIDTH,
                                                                       "max_blocks": self.max_blocks})})

    @classmethod
    def load(cls, path: str | Path) -> Refiner:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            cfg = json.loads(f.metadata()["config"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        mlps = []
        for i in range(cfg["seeds"]):
            m = SurvivalMLP(cfg["n_in"], cfg["k"], cfg["width"])
            m.load_state_dict({k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith(f"mlp{i}.")})
            mlps.append(m)
        return cls(mlps, tensors["mean"], tensors["std"], tensors["iso_x"].numpy(), tensors["iso_y"].numpy(), cfg["k"],
                   cfg.get("max_blocks"))
