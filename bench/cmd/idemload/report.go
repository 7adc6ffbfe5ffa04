package main

import (
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
)

type machineInfo struct {
	CPU        string `json:"cpu"`
	CPUs       int    `json:"cpus"`
	GOMAXPROCS int    `json:"gomaxprocs"`
	GOOS       string `json:"goos"`
	GOARCH     string `json:"goarch"`
	Go         string `json:"go"`
	PostgreSQL string `json:"postgresql"`
}

type report struct {
	Machine  machineInfo `json:"machine"`
	Config   config      `json:"config"`
	Peer     bool        `json:"peer"`
	PeerNote string      `json:"peer_note,omitempty"`
	Mixes    []mixReport `json:"mixes"`
	Targets  []target    `json:"targets"`
	Checks   []check     `json:"checks"`
	OK       bool        `json:"ok"` // every answer right, every check passed
}

type mixReport struct {
	Name      string             `json:"name"`
	DupShare  float64            `json:"duplicate_share"`
	Receivers []receiverReport   `json:"receivers"`
	Ratios    map[string]float64 `json:"ratios"` // throughput ratios: "idem/inline", ...
}

type receiverReport struct {
	Name         string  `json:"name"`
	Requests     int64   `json:"requests"`
	Errors       int64   `json:"errors"`
	FirstError   string  `json:"first_error,omitempty"`
	Throughput   float64 `json:"throughput_rps"`
	MeanMs       float64 `json:"mean_ms"`
	P50Ms        float64 `json:"p50_ms"`
	P99Ms        float64 `json:"p99_ms"`
	P999Ms       float64 `json:"p999_ms"`
	AllocBytes   float64 `json:"process_alloc_bytes_per_request"`
	AllocObjects float64 `json:"process_allocs_per_request"`
	// CPU time per request, in microseconds: the tool's process (senders
	// and receiver), and the rest of the machine (PostgreSQL, Redis, the
	// kernel); the second is left out where /proc/stat is missing.
	ToolCPUus float64  `json:"tool_cpu_us_per_request"`
	RestCPUus *float64 `json:"rest_cpu_us_per_request,omitempty"`
	New       Stmts    `json:"new"`
	Dup       Stmts    `json:"dup"`
}

type target struct {
	What  string  `json:"what"`
	Value float64 `json:"value"`
	Want  string  `json:"want"`
	Met   bool    `json:"met"`
}

type check struct {
	Receiver string `json:"receiver"`
	OK       bool   `json:"ok"`
	What     string `json:"what"`
}

// The throughput ratios reported: each of ratioNums over each of
// ratioDens that ran (idemotel's receivers over the same middleware
// without it: its cost).
var (
	ratioNums = []string{kindIdem, kindIdemCold, kindIdemPgx, kindIdemOtel, kindPgxOtel}
	ratioDens = []string{kindInline, kindBare, kindBarePgx, kindIdem, kindIdemPgx, kindPeer, kindHTTPFloor, kindFiberFloor}
)

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func (r *report) addMix(m mix, rcs []*receiver) {
	mr := mixReport{Name: m.name, DupShare: m.dupShare, Ratios: map[string]float64{}}
	tp := map[string]float64{}
	for _, rc := range rcs {
		res := rc.res
		slices.Sort(res.lat)
		var sum time.Duration
		for _, l := range res.lat {
			sum += l
		}
		rr := receiverReport{Name: rc.name, Requests: res.requests, Errors: res.errors, FirstError: res.firstErr,
			New: res.bucket.paths[pathNew].snapshot(), Dup: res.bucket.paths[pathDup].snapshot()}
		if res.elapsed > 0 {
			rr.Throughput = float64(res.requests) / res.elapsed.Seconds()
		}
		if n := len(res.lat); n > 0 {
			rr.MeanMs = ms(sum / time.Duration(n))
			rr.P50Ms, rr.P99Ms, rr.P999Ms = ms(percentile(res.lat, 0.5)), ms(percentile(res.lat, 0.99)), ms(percentile(res.lat, 0.999))
		}
		if res.requests > 0 {
			rr.AllocBytes = float64(res.allocBytes) / float64(res.requests)
			rr.AllocObjects = float64(res.allocObjs) / float64(res.requests)
			rr.ToolCPUus = float64(res.cpu.self) / float64(time.Microsecond) / float64(res.requests)
			if res.cpu.machine > 0 {
				rest := float64(max(res.cpu.machine-res.cpu.self, 0)) / float64(time.Microsecond) / float64(res.requests)
				rr.RestCPUus = &rest
			}
		}
		tp[rc.name] = rr.Throughput
		mr.Receivers = append(mr.Receivers, rr)
		rc.res = nil
	}
	for _, num := range ratioNums {
		idem, ok := tp[num]
		if !ok {
			continue
		}
		for _, other := range ratioDens {
			if v, ok := tp[other]; ok && v > 0 && other != num {
				mr.Ratios[num+"/"+other] = idem / v
			}
		}
	}
	r.Mixes = append(r.Mixes, mr)
}

func (r *report) find(mixName, rcv string) (receiverReport, bool) {
	for _, m := range r.Mixes {
		if m.Name != mixName {
			continue
		}
		for _, rr := range m.Receivers {
			if rr.Name == rcv {
				return rr, true
			}
		}
	}
	return receiverReport{}, false
}

// evaluate states issue 5's targets against this run, and whether the run
// was right.
func (r *report) evaluate() {
	r.OK = true
	for _, m := range r.Mixes {
		for _, rr := range m.Receivers {
			if rr.Errors > 0 || rr.Requests == 0 {
				r.OK = false
			}
		}
	}
	for _, c := range r.Checks {
		r.OK = r.OK && c.OK
	}
	ratio := func(what, want string, min float64, a, b receiverReport, okA, okB bool) {
		if okA && okB && b.Throughput > 0 {
			v := a.Throughput / b.Throughput
			r.Targets = append(r.Targets, target{What: what, Value: v, Want: want, Met: v >= min})
		}
	}
	idemNew, okIN := r.find("new", kindIdem)
	idemDup, okID := r.find("dup", kindIdem)
	inlNew, okLN := r.find("new", kindInline)
	inlDup, okLD := r.find("dup", kindInline)
	peerNew, okPN := r.find("new", kindPeer)
	peerDup, okPD := r.find("dup", kindPeer)
	ratio("idem new / inline new", ">= 0.95", 0.95, idemNew, inlNew, okIN, okLN)
	ratio("idem new / peer new (aim)", ">= 1.00", 1, idemNew, peerNew, okIN, okPN)
	coldNew, okCN := r.find("new", kindIdemCold)
	coldDup, okCD := r.find("dup", kindIdemCold)
	ratio("idem dup / idem new", ">= 1.50", 1.5, idemDup, idemNew, okID, okIN)
	ratio("idem dup / inline dup", ">= 1.20", 1.2, idemDup, inlDup, okID, okLD)
	ratio("idem dup / peer dup", ">= 1.00", 1, idemDup, peerDup, okID, okPD)
	ratio("idem-nocache new / inline new", ">= 0.95", 0.95, coldNew, inlNew, okCN, okLN)
	ratio("idem-nocache dup / idem-nocache new", ">= 1.50", 1.5, coldDup, coldNew, okCD, okCN)
	ratio("idem-nocache dup / inline dup", ">= 1.20", 1.2, coldDup, inlDup, okCD, okLD)
	ratio("idem-nocache dup / peer dup", ">= 1.00", 1, coldDup, peerDup, okCD, okPD)
	otelNew, okON := r.find("new", kindIdemOtel)
	ratio("idem-otel new / idem new", ">= 0.95", 0.95, otelNew, idemNew, okON, okIN)
	pgxNew, okXN := r.find("new", kindIdemPgx)
	pgxOtelNew, okXON := r.find("new", kindPgxOtel)
	ratio("idempgx-otel new / idempgx new", ">= 0.95", 0.95, pgxOtelNew, pgxNew, okXON, okXN)
	if okIN {
		v := idemNew.New.Added
		r.Targets = append(r.Targets, target{What: "idem round trips added, new event", Value: v, Want: "<= 4", Met: v <= 4})
	}
	if okID {
		v := idemDup.Dup.Added
		r.Targets = append(r.Targets, target{What: "idem round trips added, completed duplicate", Value: v, Want: "<= 3", Met: v <= 3})
	}
	if okCD {
		v := coldDup.Dup.Added
		r.Targets = append(r.Targets, target{What: "idem-nocache round trips added, completed duplicate", Value: v, Want: "<= 3", Met: v <= 3})
	}
}

func (r *report) writeJSON(w io.Writer) {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(r)
}

func (r *report) writeText(w io.Writer) {
	c := r.Config
	fmt.Fprintf(w, "idemload: %s, %d CPUs (GOMAXPROCS %d), %s %s/%s, PostgreSQL %s\n",
		r.Machine.CPU, r.Machine.CPUs, r.Machine.GOMAXPROCS, r.Machine.Go, r.Machine.GOOS, r.Machine.GOARCH, r.Machine.PostgreSQL)
	fmt.Fprintf(w, "load: %d senders, pool %d per receiver, body %d B, %d completed keys per receiver%s; %v per receiver per mix in %d interleaved rounds (+%v warm-up)\n",
		c.Concurrency, c.Pool, c.BodySize, c.Keys, map[bool]string{true: " (cold: completed by another instance)", false: ""}[c.Cold],
		c.Duration, c.Rounds, c.Warmup)
	fmt.Fprintf(w, "receivers: %s\n", strings.Join(c.Receivers, ", "))
	for _, m := range r.Mixes {
		fmt.Fprintf(w, "\nmix %s (duplicates of completed keys: %g%%)\n", m.Name, m.DupShare*100)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "receiver\treq/s\tp50 ms\tp99 ms\tp99.9 ms\trequests\terrors\tallocs/req\tKB/req\tcpu µs/req\tstmts new\tstmts dup\t")
		for _, rr := range m.Receivers {
			fmt.Fprintf(tw, "%s\t%.0f\t%.2f\t%.2f\t%.2f\t%d\t%d\t%.0f\t%.1f\t%s\t%s\t%s\t\n", rr.Name, rr.Throughput, rr.P50Ms, rr.P99Ms, rr.P999Ms,
				rr.Requests, rr.Errors, rr.AllocObjects, rr.AllocBytes/1024, cpuCell(rr), stmtsCell(rr.New), stmtsCell(rr.Dup))
		}
		_ = tw.Flush()
		for _, num := range ratioNums {
			var parts []string
			for _, den := range ratioDens {
				if v, ok := m.Ratios[num+"/"+den]; ok {
					parts = append(parts, fmt.Sprintf("/%s %.2f", den, v))
				}
			}
			if len(parts) > 0 {
				fmt.Fprintf(w, "throughput %s: %s\n", num, strings.Join(parts, ", "))
			}
		}
		for _, rr := range m.Receivers {
			if rr.FirstError != "" {
				fmt.Fprintf(w, "  %s: first error: %s\n", rr.Name, rr.FirstError)
			}
		}
	}
	fmt.Fprintln(w, "\nstmts: round trips to PostgreSQL per request, total = business (the ledger INSERT) + added")
	fmt.Fprintln(w, "  [B begin, Q query, E exec, C commit, R rollback; +r Redis commands]; allocs and KB are the")
	fmt.Fprintln(w, "  whole process's (sender + receiver) per request; cpu is tool+rest: CPU time per request of this")
	fmt.Fprintln(w, "  process (senders and receiver) and of the rest of the machine (PostgreSQL, Redis, the kernel).")
	if len(r.Targets) > 0 {
		fmt.Fprintln(w, "\ntargets (issue 5), from this run:")
		for _, t := range r.Targets {
			met := "met"
			if !t.Met {
				met = "NOT met"
			}
			fmt.Fprintf(w, "  %-45s %6.2f  want %s  %s\n", t.What, t.Value, t.Want, met)
		}
	}
	fmt.Fprintln(w, "\nexactly once:")
	for _, ch := range r.Checks {
		ok := "ok"
		if !ch.OK {
			ok = "FAILED"
		}
		fmt.Fprintf(w, "  %-12s %s: %s\n", ch.Receiver, ok, ch.What)
	}
	if r.PeerNote != "" {
		fmt.Fprintf(w, "\npeer: %s\n", r.PeerNote)
	}
	if !r.OK {
		fmt.Fprintln(w, "\nFAILED: some answers were wrong or a check failed (see above)")
	}
}

// cpuCell renders a receiver's CPU time per request: "180+310" (this
// process + the rest of the machine), or the first alone without
// /proc/stat.
func cpuCell(rr receiverReport) string {
	if rr.RestCPUus == nil {
		return fmt.Sprintf("%.0f", rr.ToolCPUus)
	}
	return fmt.Sprintf("%.0f+%.0f", rr.ToolCPUus, *rr.RestCPUus)
}

// stmtsCell renders one path's statements: "5=1+4 [B1 Q2 E1 C1]".
func stmtsCell(s Stmts) string {
	if s.Requests == 0 {
		return "-"
	}
	var parts []string
	for _, p := range []struct {
		l string
		v float64
	}{{"B", s.Begin}, {"Q", s.Query}, {"E", s.Exec}, {"C", s.Commit}, {"R", s.Rollback}} {
		if p.v > 0 {
			parts = append(parts, p.l+num(p.v))
		}
	}
	cell := num(s.Total) + "=" + num(s.Business) + "+" + num(s.Added) + " [" + strings.Join(parts, " ") + "]"
	if s.Redis > 0 {
		cell += " +r" + num(s.Redis)
	}
	return cell
}

func num(v float64) string {
	if v == float64(int64(v)) {
		return fmt.Sprintf("%d", int64(v))
	}
	return fmt.Sprintf("%.2f", v)
}

// writeMarkdown prints the machine, the load and one table per mix, with
// the ratios and the targets, as Markdown.
func (r *report) writeMarkdown(w io.Writer) {
	c := r.Config
	fmt.Fprintf(w, "Machine: %s, %d CPUs, %s, PostgreSQL %s. Load: %d senders, pool %d per receiver, %d-byte bodies, %d completed keys per receiver; %v per receiver per mix in %d interleaved rounds.\n",
		r.Machine.CPU, r.Machine.CPUs, r.Machine.Go, r.Machine.PostgreSQL, c.Concurrency, c.Pool, c.BodySize, c.Keys, c.Duration, c.Rounds)
	for _, m := range r.Mixes {
		fmt.Fprintf(w, "\n**%s** (duplicates of completed keys: %g%%)\n\n", m.Name, m.DupShare*100)
		fmt.Fprintln(w, "| receiver | req/s | p50 ms | p99 ms | p99.9 ms | round trips per request | allocs/req (process) | CPU µs/req (process + rest) |")
		fmt.Fprintln(w, "|---|---:|---:|---:|---:|---|---:|---:|")
		for _, rr := range m.Receivers {
			st := rr.New
			if m.DupShare >= 1 {
				st = rr.Dup
			}
			fmt.Fprintf(w, "| %s | %.0f | %.2f | %.2f | %.2f | %s | %.0f | %s |\n", rr.Name, rr.Throughput, rr.P50Ms, rr.P99Ms, rr.P999Ms,
				strings.ReplaceAll(stmtsCell(st), "|", "/"), rr.AllocObjects, cpuCell(rr))
		}
		for _, num := range ratioNums {
			var parts []string
			for _, den := range ratioDens {
				if v, ok := m.Ratios[num+"/"+den]; ok {
					parts = append(parts, fmt.Sprintf("%s/%s **%.2f**", num, den, v))
				}
			}
			if len(parts) > 0 {
				fmt.Fprintf(w, "\nThroughput ratios: %s.\n", strings.Join(parts, ", "))
			}
		}
	}
	if len(r.Targets) > 0 {
		fmt.Fprintln(w, "\n| target (issue 5) | this run | want | |")
		fmt.Fprintln(w, "|---|---:|---|---|")
		for _, t := range r.Targets {
			met := "met"
			if !t.Met {
				met = "**not met**"
			}
			fmt.Fprintf(w, "| %s | %.2f | %s | %s |\n", t.What, t.Value, t.Want, met)
		}
	}
}
