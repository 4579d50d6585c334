"""LitServe serving the benchmark's model repository on POST /infer, same JSON as fusedserve.

LitServe's own batching (64 rows / 2 ms by default) in its inference workers, torch eager (the
models' torch backend), its API servers in front. The peers' settings of issue 22's H200 run: 2 GPU
workers and 8 API servers on CUDA; 1 and 1 on a CPU (1 torch thread). Optional: bench/load.py skips
it where litserve does not import.

    python bench/peers/litserve_app.py --port 8000 --device cpu --repository PATH
"""

import argparse

import litserve as ls
import torch


class RepositoryAPI(ls.LitAPI):
    def __init__(self, repository: str, **kwargs):
        super().__init__(**kwargs)
        self.repository = repository

    def setup(self, device):
        from fusedserve.models import load_repository

        if device == "cpu":
            torch.set_num_threads(1)
        self.device = device
        self.models = load_repository(self.repository, device=device, backend="torch")

    def decode_request(self, request):
        return request.get("model") or next(iter(self.models)), request["inputs"]

    def batch(self, inputs):
        return inputs  # a list of (model, rows): predict groups them by model

    def predict(self, batch):
        outputs = [None] * len(batch)
        for name in {name for name, _ in batch}:
            picks = [i for i, (n, _) in enumerate(batch) if n == name]
            rows = [row for i in picks for row in batch[i][1]]
            with torch.inference_mode():
                y = self.models[name](torch.tensor(rows, dtype=torch.float32, device=self.device)).float().cpu()
            start = 0
            for i in picks:
                count = len(batch[i][1])
                outputs[i] = (name, y[start:start + count].tolist())
                start += count
        return outputs

    def unbatch(self, output):
        return output

    def encode_response(self, output):
        return {"model": output[0], "outputs": output[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repository", required=True)
    parser.add_argument("--workers-per-device", type=int, default=None, help="default: 1 on CPU, 2 on CUDA")
    parser.add_argument("--api-servers", type=int, default=None, help="default: 1 on CPU, 8 on CUDA")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--batch-timeout-ms", type=float, default=2.0)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    api = RepositoryAPI(args.repository, max_batch_size=args.max_batch_size,
                        batch_timeout=args.batch_timeout_ms / 1e3, api_path="/infer")
    server = ls.LitServer(api, accelerator=args.device, devices=1,
                          workers_per_device=args.workers_per_device or (2 if cuda else 1))
    server.run(host="127.0.0.1", port=args.port, num_api_servers=args.api_servers or (8 if cuda else 1),
               log_level="warning", generate_client_file=False)


if __name__ == "__main__":
    main()
