package main

import (
	"bytes"
	"context"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

func TestParseMixesAcceptsNamesAndShares(t *testing.T) {
	ms, err := parseMixes("new, dup,0.25")
	if err != nil {
		t.Fatal(err)
	}
	want := []mix{{"new", 0}, {"dup", 1}, {"dup25%", 0.25}}
	if len(ms) != len(want) {
		t.Fatalf("got %v, want %v", ms, want)
	}
	for i := range want {
		if ms[i] != want[i] {
			t.Errorf("mix %d: got %v, want %v", i, ms[i], want[i])
		}
	}
	for _, bad := range []string{"", "old", "1.5", "-0.1"} {
		if _, err := parseMixes(bad); err == nil {
			t.Errorf("parseMixes(%q) accepted", bad)
		}
	}
}

func TestPercentileIsNearestRank(t *testing.T) {
	var d []time.Duration
	for i := 1; i <= 1000; i++ {
		d = append(d, time.Duration(i))
	}
	for q, want := range map[float64]time.Duration{0.5: 500, 0.99: 990, 0.999: 999, 1: 1000} {
		if got := percentile(d, q); got != want {
			t.Errorf("percentile(%v) = %v, want %v", q, got, want)
		}
	}
	if percentile(nil, 0.5) != 0 {
		t.Error("percentile of nothing is not 0")
	}
}

func TestSendBodyIsTheSameBytesForTheSameEvent(t *testing.T) {
	a, b := sendBody("evt_1", 1024), sendBody("evt_1", 1024)
	if !bytes.Equal(a, b) || len(a) != 1024 {
		t.Fatalf("len %d, equal %v", len(a), bytes.Equal(a, b))
	}
	if !strings.HasPrefix(string(a), `{"id":"evt_1"`) {
		t.Errorf("body %.40s", a)
	}
}

func TestStatementsAreAveragedPerRequest(t *testing.T) {
	var p pathStats
	for i := 0; i < 2; i++ {
		var c reqCount
		c.begin.Add(1)
		c.query.Add(2)
		c.exec.Add(1)
		c.commit.Add(1)
		c.business.Add(1)
		p.add(&c)
	}
	s := p.snapshot()
	if s.Requests != 2 || s.Total != 5 || s.Business != 1 || s.Added != 4 {
		t.Fatalf("got %+v", s)
	}
	if got := stmtsCell(s); got != "5=1+4 [B1 Q2 E1 C1]" {
		t.Errorf("cell %q", got)
	}
}

// The pgx receivers' round trips: a batch is one, named by how it begins
// or ends a transaction, as idempgx sends a new event ([BEGIN, claim],
// the ledger INSERT, [the answer, COMMIT]) and a bare pgx transaction.
func TestCountingTracerCountsPgxRoundTrips(t *testing.T) {
	var tr countingTracer
	c := &reqCount{}
	ctx := withCount(context.Background(), c)
	send := func(b *pgx.Batch) { tr.TraceBatchStart(ctx, nil, pgx.TraceBatchStartData{Batch: b}) }
	batch := func(sqls ...string) {
		var b pgx.Batch
		for _, s := range sqls {
			b.Queue(s)
		}
		send(&b)
	}
	query := func(sql string) { tr.TraceQueryStart(ctx, nil, pgx.TraceQueryStartData{SQL: sql}) }

	var claim pgx.Batch // as idempgx begins: pgx queues the BEGIN first
	claim.BeginTx(pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	claim.Queue("SELECT pg_try_advisory_xact_lock($3)")
	send(&claim)
	query(businessPrefix + "idempgx (event_id, body) VALUES ($1, $2)")
	batch("INSERT INTO keys_idempgx VALUES ($1)", "COMMIT")
	batch("SELECT 1", "SELECT 2")
	batch("UPDATE keys SET x = 1", "ROLLBACK")
	query("begin")
	query(" commit;")
	query("Rollback")

	got := [6]int32{c.begin.Load(), c.query.Load(), c.exec.Load(), c.commit.Load(), c.rollback.Load(), c.business.Load()}
	if want := [6]int32{2, 2, 0, 2, 2, 1}; got != want {
		t.Fatalf("begin, query, exec, commit, rollback, business = %v, want %v", got, want)
	}
}

// The CPU cell: this process + the rest of the machine, the rest left out
// only where it is unknown (a cached duplicate may cost the rest nothing).
func TestCPUCellTellsUnknownFromNothing(t *testing.T) {
	zero, some := 0.0, 194.4
	for _, c := range []struct {
		rr   receiverReport
		want string
	}{
		{receiverReport{ToolCPUus: 176.2, RestCPUus: &some}, "176+194"},
		{receiverReport{ToolCPUus: 37, RestCPUus: &zero}, "37+0"},
		{receiverReport{ToolCPUus: 37}, "37"},
	} {
		if got := cpuCell(c.rr); got != c.want {
			t.Errorf("cpuCell(%+v) = %q, want %q", c.rr, got, c.want)
		}
	}
	if runtime.GOOS != "linux" {
		return // no /proc/stat
	}
	if s := machineBusy(); s <= 0 {
		t.Errorf("machineBusy() = %v on Linux, want the CPUs' busy time", s)
	}
	if s := processCPU(); s <= 0 {
		t.Errorf("processCPU() = %v, want this process's CPU time", s)
	}
}
