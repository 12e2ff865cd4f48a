"""How fast the demo's image tower can run here: ONNX Runtime fp32 by batch size, and int8 static quantisation
(ONNX Runtime's, QDQ and QOperator, per-channel weights).

Usage::

    .venv/bin/python -m benchmarks.tower_ceiling [--data demo/data] [--seconds 6]

Inputs are the data's thumbnails through the eval transform (256 to calibrate int8, 256 others to compare; Gaussian
noise when ``--data`` has no images). Each row: images per second over ``--seconds`` of repeated batches, and the
cosine of its output rows to ONNX Runtime fp32's (min / mean). The header prints the load average: only a quiet
machine's rates are the tower's ceiling.
"""

from __future__ import annotations

import argparse
import glob
import os
import tempfile
import time

import numpy as np


def _session(path: str, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads, options.log_severity_level = threads, 1, 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def _rate(run, batch: np.ndarray, seconds: float) -> float:
    run(batch)
    started, done = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        run(batch)
        done += len(batch)
    return done / (time.perf_counter() - started)


def _cosines(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return float(cos.min()), float(cos.mean())


def _inputs(data: str, tower) -> tuple[np.ndarray, np.ndarray]:
    """(256 calibration, 256 comparison) images (N, 3, S, S) from ``data``'s thumbnails, else noise."""
    from PIL import Image

    files = sorted(glob.glob(os.path.join(data, "images", "**", "*.png"), recursive=True))
    rng = np.random.default_rng(0)
    if len(files) < 512:
        return tuple(rng.standard_normal((256, 3, tower.image_size, tower.image_size)).astype(np.float32) for _ in "ab")
    transform = tower.image_transform(False)
    picked = rng.choice(files, 512, replace=False)
    images = np.stack([transform(Image.open(f)).numpy() for f in picked])
    return images[:256], images[256:]


def _quantised(fp32: str, calibration: np.ndarray, folder: str) -> dict[str, str]:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):  # one per quantisation: it is used up
        def get_next(self):
            self.batches = getattr(self, "batches", iter([{"images": calibration[i:i + 32]} for i in range(0, 256, 32)]))
            return next(self.batches, None)

    out = {}
    for name, form in (("int8 QDQ", QuantFormat.QDQ), ("int8 QOperator", QuantFormat.QOperator)):
        out[name] = os.path.join(folder, name.replace(" ", "_") + ".onnx")
        quantize_static(fp32, out[name], Reader(), quant_format=form, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--data", default="demo/data", help="a prepared data folder (its images/)")
    parser.add_argument("--seconds", type=float, default=6.0, help="timed seconds per row")
    args = parser.parse_args(argv)
    from triclip.model.accel import _onnx_bytes
    from triclip.model.towers import ImageTower

    tower = ImageTower(0).eval()
    calibration, compare = _inputs(args.data, tower)
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs, EfficientNet-Lite0 at {tower.image_size} px")
    with tempfile.TemporaryDirectory() as folder:
        fp32 = os.path.join(folder, "fp32.onnx")
        with open(fp32, "wb") as f:
            f.write(_onnx_bytes(tower, tower.image_size))
        base = _session(fp32, 2)
        reference = base.run(None, {"images": compare})[0]
        run = lambda s: (lambda x: s.run(None, {"images": x})[0])  # noqa: E731
        for size in (8, 32, 64):
            print(f"fp32, 2 threads, batch {size:3d}: {_rate(run(base), compare[:size], args.seconds):6.1f} img/s")
        for name, path in _quantised(fp32, calibration, folder).items():
            session = _session(path, 2)
            print(f"{name}, 2 threads, batch 64: {_rate(run(session), compare[:64], args.seconds):6.1f} img/s,"
                  " cosine min %.4f mean %.4f" % _cosines(run(session)(compare), reference))


if __name__ == "__main__":
    main()
