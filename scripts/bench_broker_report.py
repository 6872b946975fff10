"""The broker benchmark's report: the fan-in figures of propeller and mosquitto side by side.

Run by `scripts/bench-broker.sh`, which starts the processes and passes their ports and pids;
see that script for what is measured."""
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
cases = []
for r in rows:
    if r["case"] not in cases:
        cases.append(r["case"])
def med(side, case, key):
    vals = [r["run"][key] for r in rows if r["side"] == side and r["case"] == case and key in r["run"]]
    return statistics.median(vals) if vals else float("nan")
print()
print("| publishers | QoS | ours msg/s | mosquitto msg/s | ratio | ours p50/p99 µs | mosquitto p50/p99 µs | delivered ours / mosquitto |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|")
for case in cases:
    pubs, qos = case.split("/")
    o, m = med("ours", case, "msgs_per_s"), med("mosquitto", case, "msgs_per_s")
    ratio = o / m if m else float("nan")
    print(f"| {pubs} | {qos} | {o:,.0f} | {m:,.0f} | {ratio:.2f}x | {med('ours', case, 'p50_us'):,.0f} / {med('ours', case, 'p99_us'):,.0f} | {med('mosquitto', case, 'p50_us'):,.0f} / {med('mosquitto', case, 'p99_us'):,.0f} | {med('ours', case, 'received'):,.0f} / {med('mosquitto', case, 'received'):,.0f} |")
