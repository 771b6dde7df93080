"""`slow-jpeg-decode`: Pillow decodes the script's JPEGs; libjpeg-turbo bindings are faster (T04)."""

from __future__ import annotations

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import finding, saving_gain, step_ms

SHARE = 0.25  # decode share of __getitem__ worth reporting


@register("slow-jpeg-decode", priority=40, techniques=("T04",), summary="JPEG decoding with Pillow dominates __getitem__")
def check(obs: Observation):
    for ds in obs.get("datasets", []):
        if not any(k == "PIL JPEG" for k in ds.get("decoders", {})) or ds["decode_share"] < SHARE:
            continue
        alt = ds.get("alt_decode")
        evidence = (f"{ds['dataset']}[i]: Pillow decodes JPEG in {ds['decode_ms']:.3f} of {ds['getitem_ms']:.3f} ms "
                    f"({ds['decode_share']:.0%})")
        est, basis = None, "estimated"
        if alt:
            evidence += f"; {alt['best']} decodes the same files {alt['speedup']:.2f}x faster here"
            b = obs.get("breakdown", {})
            ld = (obs.get("loaders") or [{}])[0]
            if ld.get("num_workers", 0) == 0 and ds.get("batch_size"):
                saved = ds["decode_ms"] * ds["batch_size"] * (1 - 1 / max(alt["speedup"], 1e-9))
                est = saving_gain(step_ms(obs), min(saved, b.get("data_wait_ms", 0.0)))
                basis = "timed"  # both decoders timed on the script's files, the wait timed in its loop
            else:
                est = 1.0 + 0.5 * max(0.0, b.get("fractions", {}).get("data_wait", 0.0)) * (1 - 1 / max(alt["speedup"], 1))
        fix = ("decode with simplejpeg.decode_jpeg(open(path, 'rb').read(), colorspace='RGB') or "
               "cv2.imdecode (libjpeg-turbo), or torchvision.io.decode_jpeg; add `fastdct=True` when slight "
               "quality loss is fine (T04)")
        return finding("slow-jpeg-decode", evidence=evidence, fix=fix, est_gain=est, obs=obs, basis=basis)
    return None
