"""tools/provisional_check.py: today's provisional choice on a held-out run, against its tuned winner."""

from tools.provisional_check import check, summary, table_without


def _rows(M, dtype, tuned, config, tuned_us, provisional_us, vendor_us, N=1024, K=1024):
    common = dict(M=M, N=N, K=K, dtype=dtype)
    return [dict(common, impl="fusedserve_static_weight", median_us=tuned_us, kernel=tuned, config=config),
            dict(common, impl="fusedserve_provisional", median_us=provisional_us, kernel="x", config=""),
            dict(common, impl="cublaslt_fused", median_us=vendor_us)]


def _run(date, rows):
    return dict(gpu="G", triton="3.6.0", date=date, rows=rows)


def test_a_held_out_run_is_checked_against_a_table_of_the_others():
    seen = _run("2026-01-01", [dict(impl="fusedserve_static_weight", M=16, N=1024, K=1024, dtype="bfloat16",
                                    median_us=1.0, kernel="gluon_small_m", config="BLOCK_N=64")])
    held = _run("2026-01-02", [
        # one 16-bit row: the GEMV claims it; the tuned winner was the GEMV: the same family
        *_rows(1, "bfloat16", "triton_small_m", "GEMV=True,BLOCK_N=8", 2.0, 3.0, 4.0),
        # past 64 rows the vendor claims a layer that is not small: its measured time over the tuned one
        *_rows(200, "bfloat16", "gluon_ws", "BLOCK_M=128", 10.0, 30.0, 11.0, N=2048, K=2048),
        # 16 rows: the other run's gluon_small_m against a tuned triton_small_m: not measured
        *_rows(16, "bfloat16", "triton_small_m", "BLOCK_N=64", 2.0, 2.0, 3.0),
    ])
    entries = table_without([seen, held], held)
    assert [e.kernel for e in entries] == ["gluon_small_m"], "the held-out run is not in its own table"
    found = {r["M"]: r for r in check(held, entries)}
    assert (found[1]["choice"], found[1]["estimate"], found[1]["same_family"]) == ("triton_small_m", 1.0, True)
    assert not found[200]["same_family"]
    assert (found[200]["choice"], found[200]["estimate"], found[200]["measured_then"]) == ("torch_cublas", 1.1, 3.0)
    assert (found[16]["choice"], found[16]["estimate"]) == ("gluon_small_m", None)
    text = summary(list(found.values()))
    assert "over 1.05x the tuned time on 1 (worst 1.1x), unknown on 1" in text, text


def test_a_near_search_is_checked_for_the_full_searchs_winner():
    seen = _run("2026-01-01", [dict(impl="fusedserve_static_weight", M=128, N=1024, K=1024, dtype="bfloat16",
                                    median_us=1.0, kernel="gluon_small_m", config="BLOCK_N=64")])
    held = _run("2026-01-02", [*_rows(200, "bfloat16", "torch_cublas", "op=addmm_act (cuBLASLt)", 10.0, 10.0, 10.0),
                               *_rows(300, "bfloat16", "gluon_ws", "BLOCK_M=128", 10.0, 30.0, 11.0)])
    found = {r["M"]: r for r in check(held, table_without([seen, held], held))}
    assert found[200]["near_holds_winner"], "the vendor always competes in a near search"
    assert not found[300]["near_holds_winner"], "a full search here, but the config is no candidate"
    assert found[200]["near_candidates"] < found[200]["full_candidates"]
    assert found[300]["near_candidates"] == found[300]["full_candidates"], "no entry of an offered family: full"
    assert "hold the full search's winner on 1" in summary(list(found.values()))
