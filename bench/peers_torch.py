"""The PyTorch peers of bench/search.py: float32 (TF32 off), TF32, and a half-precision GEMM; imported lazily."""

from __future__ import annotations

from peer_base import GPU_BLOCK, Built, Unsupported, block_rows


def torch_gpu() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "torch.cuda.is_available() is False"


def _torch_clock(call) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


TORCH_DTYPES = ("float32", "float16", "bfloat16", "int8", "uint8")


def _torch_set_tf32(torch, enabled: bool) -> None:
    """TF32 for float32 matmuls on or off (torch.backends.cuda.matmul.allow_tf32, as PyTorch users set it)."""
    torch.backends.cuda.matmul.allow_tf32 = enabled


def _torch_half_mm(torch, dtype, device):
    """(mm of `dtype` matrices with float32 accumulation and output, what it does): torch.mm(out_dtype=float32)
    where this PyTorch has it (2.8 and later, CUDA), else the half-precision product widened afterwards."""
    probe = torch.ones((2, 8), dtype=dtype, device=device)
    name = str(dtype).replace("torch.", "")
    try:
        torch.mm(probe, probe.T, out_dtype=torch.float32)
        return (lambda a, b: torch.mm(a, b, out_dtype=torch.float32)), \
            f"torch.mm(out_dtype=float32): {name} in, float32 accumulate and out"
    except (TypeError, RuntimeError, NotImplementedError):
        return (lambda a, b: torch.mm(a, b).float()), f"torch.mm: {name} in and out (no out_dtype here), then .float()"


def _torch_aux(torch, base, metric: str):
    """prepare()'s |x|^2 (l2) or 1 / |x| (cosine) for a torch database, in float32."""
    if metric == "ip":
        return None
    norm2 = base.float().pow(2).sum(dim=1)
    if metric == "l2":
        return norm2
    norm = norm2.sqrt()
    return torch.where(norm > 0, 1 / torch.where(norm > 0, norm, 1.0), 0.0)


def build_torch(mode: str):
    """mode "fp32" (TF32 off), "tf32" (torch.backends.cuda.matmul.allow_tf32 = True): float32 storage only;
    "fp16": half-precision GEMM on every storage dtype (float16; bfloat16 storage multiplies in bfloat16;
    8-bit values are exact in float16; float32 storage is rounded to float16)."""
    def build(db, config, device="cuda"):
        import torch

        if config.dtype not in TORCH_DTYPES:
            raise Unsupported(f"no PyTorch path for dtype {config.dtype!r}")
        if mode != "fp16" and config.dtype != "float32":
            raise Unsupported(f"torch-{mode} runs on float32 storage; torch-fp16 is the half-precision peer")
        gemm = torch.float32 if mode != "fp16" else torch.bfloat16 if config.dtype == "bfloat16" else torch.float16
        base = torch.from_numpy(db).to(device)
        base = (base.float() if base.dtype != torch.float32 else base).to(gemm)
        half_mm, note = _torch_half_mm(torch, gemm, device) if mode == "fp16" else \
            (None, f"torch.addmm / torch.mm in float32, allow_tf32={mode == 'tf32'}")
        aux = _torch_aux(torch, base, config.metric)
        if mode != "fp16":
            _torch_set_tf32(torch, mode == "tf32")
            note += f" (read back: {torch.backends.cuda.matmul.allow_tf32})"
        rows = block_rows(len(db), GPU_BLOCK)
        metric = config.metric
        larger = metric != "l2"

        @torch.inference_mode()
        def resident(q, k=config.k):
            _torch_set_tf32(torch, mode == "tf32")
            q = q.float()
            out_d = torch.empty((len(q), k), dtype=torch.float32, device=q.device)
            out_i = torch.empty((len(q), k), dtype=torch.int64, device=q.device)
            for start in range(0, len(q), rows):
                qb = q[start:start + rows]
                if half_mm is None and metric == "l2":   # l2 by the expansion, fused: |x|^2 - 2 q.x
                    key = torch.addmm(aux, qb, base.T, alpha=-2)
                else:
                    key = torch.mm(qb, base.T) if half_mm is None else half_mm(qb.to(gemm), base.T)
                    key = key.mul_(-2).add_(aux) if metric == "l2" else key.mul_(aux) if metric == "cosine" else key
                best, ids = torch.topk(key, k, dim=1, largest=larger, sorted=True)
                q_norm2 = (qb * qb).sum(dim=1, keepdim=True)
                out_d[start:start + len(qb)] = (best + q_norm2 if metric == "l2" else best if metric == "ip" else
                                                best / torch.where(q_norm2 > 0, q_norm2.sqrt(), 1.0))
                out_i[start:start + len(qb)] = ids
            return out_d, out_i

        def search(q, k=config.k):
            dist, ids = resident(torch.from_numpy(q).to(device), k)
            return dist.cpu().numpy(), ids.cpu().numpy()

        def close():
            nonlocal base, aux
            base = aux = None
            if device == "cuda":
                torch.cuda.empty_cache()

        to_device = lambda q: torch.from_numpy(q).to(device)  # noqa: E731
        return Built(search, close, resident=resident, to_device=to_device, clock=_torch_clock, note=note)

    return build
