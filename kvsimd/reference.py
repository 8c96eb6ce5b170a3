"""Plain NumPy float64 references for kvsimd's kernels.

Slow and simple on purpose: the tests compare every ISA path against these, and users can
use them to check kvsimd on their own data.  Inputs of any float dtype are widened to float64
(so fp16 caches are compared against exact math on their fp16-rounded values)."""
from __future__ import annotations

import numpy as np

__all__ = ["attend", "alibi_distances", "rope_angles", "apply_rope", "shift_keys", "rotate_pairs"]


def _scores(q, k, scale, alibi_slopes, distances):
    """float64 scores ``[H, N]`` of q against k (GQA: query head h reads KV head h // (H // Hkv));
    ALiBi subtracts ``slope * distance`` (distance = query position - key position)."""
    H, D = q.shape
    Hkv, N, _ = k.shape
    kh = np.repeat(k, H // Hkv, axis=0)
    s = np.einsum("hd,hnd->hn", q, kh) * float(1.0 / np.sqrt(D) if scale is None else scale)
    if alibi_slopes is not None:
        s = s - np.asarray(alibi_slopes, np.float64)[:, None] * distances[None, :]
    return s


def alibi_distances(n_keys, key_positions=None, query_position=None, ranges=None):
    """float64 ``query position - key position`` of every key ``[N]``, as :func:`attention_weights`
    reads them: key positions default to the slots, the query position to N - 1, and a range
    ``(t0, t1, use_q_alt, query_position)`` has its own query position (keys outside every
    range: 0)."""
    N = int(n_keys)
    kp = np.arange(N, dtype=np.float64) if key_positions is None else np.asarray(key_positions, np.float64)
    qp = N - 1 if query_position is None else query_position
    if ranges is None:
        return float(qp) - kp
    d = np.zeros(N)
    for r in ranges:
        t0, t1 = int(r[0]), int(r[1])
        d[t0:t1] = float(r[3] if len(r) > 3 else qp) - kp[t0:t1]
    return d


def attention_weights(q, k, *, scale=None, alibi_slopes=None, key_positions=None, query_position=None,
                      ranges=None, q_alt=None):
    """float64 softmax weights ``[H, N]`` of single-query attention (GQA/MQA, optional ALiBi).

    ``ranges`` (as :func:`kvsimd.ops.attend`): only the keys of the ranges get weight, one
    softmax over all of them; a range with ``use_q_alt`` is scored with ``q_alt``, and its ALiBi
    distances from its own query position.  Keys outside every range get weight 0."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    Hkv, N, _ = k.shape
    dist = alibi_distances(N, key_positions, query_position, ranges)
    if ranges is None:
        s = _scores(q, k, scale, alibi_slopes, dist)
    else:
        s = np.full((q.shape[0], N), -np.inf)
        for r in ranges:
            t0, t1 = int(r[0]), int(r[1])
            qq = np.asarray(q_alt, np.float64) if len(r) > 2 and r[2] else q
            s[:, t0:t1] = _scores(qq, k[:, t0:t1], scale, alibi_slopes, dist[t0:t1])
    s = s - s.max(axis=1, keepdims=True)
    p = np.exp(s)
    return p / p.sum(axis=1, keepdims=True)


def attend(q, k, v, **kw):
    """float64 single-query attention ``softmax(scale * k @ q + bias) @ v``; returns ``[H, D]``.
    Keywords as :func:`attention_weights`."""
    p = attention_weights(q, k, **kw)
    v = np.asarray(v, dtype=np.float64)
    return np.einsum("hn,hnd->hd", p, np.repeat(v, p.shape[0] // v.shape[0], axis=0))


def rope_angles(positions, *, theta=10000.0, rotary_dim):
    """Angles ``[N, rotary_dim/2]``: ``position * theta ** (-2i / rotary_dim)`` in float64."""
    pos = np.asarray(positions, dtype=np.float64)
    i = np.arange(rotary_dim // 2, dtype=np.float64)
    inv = float(theta) ** (-2.0 * i / rotary_dim)
    return pos[:, None] * inv[None, :]


def rotate_pairs(x, angles, *, style="gptj", rotary_dim=None):
    """Rotate the pairs of ``x [H, N, D]`` by ``angles [N, R]``; returns a new float64 array."""
    x = np.array(x, dtype=np.float64)
    D = x.shape[-1]
    rd = D if rotary_dim is None else rotary_dim
    R = rd // 2
    c, s = np.cos(angles)[None], np.sin(angles)[None]
    if style == "gptj":
        a, b = x[..., 0:rd:2].copy(), x[..., 1:rd:2].copy()
        x[..., 0:rd:2] = a * c - b * s
        x[..., 1:rd:2] = b * c + a * s
    elif style == "neox":
        a, b = x[..., :R].copy(), x[..., R:rd].copy()
        x[..., :R] = a * c - b * s
        x[..., R:rd] = b * c + a * s
    else:
        raise ValueError("style must be 'gptj' or 'neox'")
    return x


def apply_rope(x, positions, *, theta=10000.0, style="gptj", rotary_dim=None):
    """float64 RoPE of ``x [H, N, D]`` at ``positions [N]``; returns a new array."""
    rd = np.shape(x)[-1] if rotary_dim is None else rotary_dim
    return rotate_pairs(x, rope_angles(positions, theta=theta, rotary_dim=rd), style=style, rotary_dim=rd)


def shift_keys(k, delta, *, theta=10000.0, style="gptj", rotary_dim=None, start=0, stop=None):
    """float64 rotation of tokens ``start..stop-1`` of ``k [Hkv, N, D]`` by ``delta`` positions."""
    k = np.array(k, dtype=np.float64)
    stop = k.shape[1] if stop is None else stop
    rd = k.shape[-1] if rotary_dim is None else rotary_dim
    ang = rope_angles(np.full(stop - start, delta), theta=theta, rotary_dim=rd)
    k[:, start:stop] = rotate_pairs(k[:, start:stop], ang, style=style, rotary_dim=rd)
    return k
