"""benchmarks.ncu_mla_decode's summaries of ncu's CSV pages (the profiles themselves need the H200's ncu)."""
from benchmarks.ncu_mla_decode import summarize_raw, summarize_source

RAW = ('"ID","gpu__time_duration.sum","dram__bytes.sum.per_second","launch__registers_per_thread",'
       '"smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",'
       '"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"\n'
       '"","nsecond","Gbyte/s","register/thread","",""\n'
       '"0","149,216","1044.7","231","0.872","2.166"\n')
SOURCE = ('"Kernel Name","_mla_decode_kernel",\n'
          '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"\n'
          '"0x10","IMAD.MOV.U32 R28, RZ, RZ, R66","30","300"\n'
          '"0x20","@!P0 LOP3.LUT R1, R2, 0xff, RZ, 0xc0, !PT","10","200"\n'
          '"0x30","HMMA.16816.F32.BF16 R28, R28, R34, RZ","60","100"\n'
          '"0x40","LOP3.LUT R3, R2, 0xff, RZ, 0xc0, !PT","0","100"\n')


def test_raw_page_units_and_stalls():
    got = summarize_raw(RAW)
    assert got["duration_us"] == 149.216 and got["dram_tbps"] == 1.045 and got["registers"] == 231
    assert list(got["stalls_per_issue"]) == ["long_scoreboard", "wait"]  # largest first


def test_source_page_per_token_counts():
    got = summarize_source(SOURCE, tokens=10)
    assert got["warp_instr_per_token"] == 70.0
    assert got["per_token_by_opcode"] == {"LOP3": 30.0, "IMAD": 30.0, "HMMA": 10.0}  # predicates stripped
    assert got["imad_mov_per_token"] == 30.0
    assert got["stall_sample_share"]["HMMA"] == 0.6
