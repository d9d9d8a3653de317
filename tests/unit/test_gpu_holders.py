"""Which processes hold the GPUs a job was given, from nvidia-smi's CSV (runtime.vllm_server)."""

from eagleflow.runtime.gpus import describe_gpu_holders

GPUS = "0, GPU-aaa\n1, GPU-bbb\n2, GPU-ccc\n"
APPS = "GPU-bbb, 4242, /usr/bin/python3, 70123 MiB\nGPU-ccc, 777, vllm, 1024 MiB\n"


def test_only_the_jobs_gpus_are_reported_by_index_or_uuid():
    assert describe_gpu_holders(GPUS, APPS, "0,1") == ["GPU 1: pid 4242 (/usr/bin/python3) holds 70123 MiB"]
    assert describe_gpu_holders(GPUS, APPS, "GPU-ccc") == ["GPU 2: pid 777 (vllm) holds 1024 MiB"]
    assert len(describe_gpu_holders(GPUS, APPS, None)) == 2
    assert describe_gpu_holders(GPUS, "", "0,1,2") == []
