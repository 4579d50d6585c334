"""Classify handwritten digits with a running fusedserve, over HTTP with the standard library alone.

    fusedserve serve                       # in another terminal: the shipped digits model
    python examples/client.py              # or --url http://host:8000 --api-key KEY

Sends every digit of scikit-learn's bundled data set if scikit-learn is installed (else three digits
written out below) in batches of --batch rows per request, and prints the accuracy and the rate.
"""

import argparse
import json
import time
import urllib.error
import urllib.request

# The first three digits of scikit-learn's load_digits (8x8 pixels, 0-16, row by row) and their classes.
SAMPLES = [
    ([0, 0, 5, 13, 9, 1, 0, 0, 0, 0, 13, 15, 10, 15, 5, 0, 0, 3, 15, 2, 0, 11, 8, 0, 0, 4, 12, 0, 0, 8, 8, 0,
      0, 5, 8, 0, 0, 9, 8, 0, 0, 4, 11, 0, 1, 12, 7, 0, 0, 2, 14, 5, 10, 12, 0, 0, 0, 0, 6, 13, 10, 0, 0, 0], 0),
    ([0, 0, 0, 12, 13, 5, 0, 0, 0, 0, 0, 11, 16, 9, 0, 0, 0, 0, 3, 15, 16, 6, 0, 0, 0, 7, 15, 16, 16, 2, 0, 0,
      0, 0, 1, 16, 16, 3, 0, 0, 0, 0, 1, 16, 16, 6, 0, 0, 0, 0, 1, 16, 16, 6, 0, 0, 0, 0, 0, 11, 16, 10, 0, 0], 1),
    ([0, 0, 0, 4, 15, 12, 0, 0, 0, 0, 3, 16, 15, 14, 0, 0, 0, 0, 8, 13, 8, 16, 0, 0, 0, 0, 1, 6, 15, 11, 0, 0,
      0, 1, 8, 13, 15, 1, 0, 0, 0, 9, 16, 16, 5, 0, 0, 0, 0, 3, 13, 16, 16, 11, 5, 0, 0, 0, 0, 3, 11, 16, 9, 0], 2),
]


def digits() -> tuple[list[list[float]], list[int]]:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        return [row for row, _ in SAMPLES], [label for _, label in SAMPLES]
    data = load_digits()
    return data.data.tolist(), data.target.tolist()


def infer(url: str, rows: list[list[float]], api_key: str | None) -> list[list[float]]:
    """POST /infer; a refusal raises with the server's own message ({"error": ...})."""
    headers = {"content-type": "application/json"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    body = json.dumps({"model": "digits", "inputs": rows}).encode()
    request = urllib.request.Request(f"{url}/infer", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return json.load(answer)["outputs"]
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"{exc.code} from the server: {json.load(exc).get('error')}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None, help="if the server has one (FUSEDSERVE_API_KEY)")
    parser.add_argument("--batch", type=int, default=64, help="rows per request")
    args = parser.parse_args()
    rows, labels = digits()
    start, right = time.perf_counter(), 0
    for i in range(0, len(rows), args.batch):
        outputs = infer(args.url, rows[i:i + args.batch], args.api_key)
        right += sum(out.index(max(out)) == label for out, label in zip(outputs, labels[i:i + args.batch], strict=True))
    seconds = time.perf_counter() - start
    print(f"{right}/{len(rows)} right ({right / len(rows):.1%}) in {seconds:.2f} s, {len(rows) / seconds:.0f} rows/s")


if __name__ == "__main__":
    main()
