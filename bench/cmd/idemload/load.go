package main

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"runtime"
	"runtime/metrics"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// mix is one workload: the share of requests that are duplicates of
// completed keys; the rest carry keys never sent before.
type mix struct {
	name     string
	dupShare float64
}

// parseMixes reads -mix: "new" (no duplicates), "dup" (only completed
// duplicates), or a duplicate share between 0 and 1 ("0.3").
func parseMixes(s string) ([]mix, error) {
	var out []mix
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		switch f {
		case "":
			continue
		case "new":
			out = append(out, mix{"new", 0})
		case "dup":
			out = append(out, mix{"dup", 1})
		default:
			v, err := strconv.ParseFloat(f, 64)
			if err != nil || v < 0 || v > 1 {
				return nil, fmt.Errorf("-mix: %q is not new, dup or a share between 0 and 1", f)
			}
			out = append(out, mix{fmt.Sprintf("dup%g%%", v*100), v})
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("-mix: no mix given")
	}
	return out, nil
}

// mixResult sums one receiver's measured slots in one mix.
type mixResult struct {
	requests   int64
	errors     int64
	elapsed    time.Duration
	lat        []time.Duration
	allocBytes uint64
	allocObjs  uint64
	cpu        cpuSample // the slots' CPU time: the tool's process, the machine
	firstErr   string
	bucket     bucket
}

// sendBody builds the JSON body of one event: about size bytes, the same
// bytes every time for the same id.
func sendBody(eventID string, size int) []byte {
	head := `{"id":` + strconv.Quote(eventID) + `,"type":"payment.succeeded","pad":"`
	pad := size - len(head) - 2
	b := make([]byte, 0, len(head)+max(pad, 0)+2)
	b = append(b, head...)
	for i := 0; i < pad; i++ {
		b = append(b, 'x')
	}
	return append(b, `"}`...)
}

// outcome of one request as the sender sees it.
type outcome struct {
	status int
	body   []byte
	err    error
}

// post sends one event; buf is reused for the answer.
func post(ctx context.Context, rc *receiver, eventID, path string, body []byte, buf *bytes.Buffer) outcome {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, rc.url, bytes.NewReader(body))
	if err != nil {
		return outcome{err: err}
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(eventHeader, eventID)
	req.Header.Set(pathHeader, path)
	res, err := rc.client.Do(req)
	if err != nil {
		return outcome{err: err}
	}
	defer res.Body.Close()
	buf.Reset()
	if _, err := buf.ReadFrom(res.Body); err != nil {
		return outcome{status: res.StatusCode, err: err}
	}
	return outcome{status: res.StatusCode, body: buf.Bytes()}
}

// checkAnswer says what is wrong with an answer, "" if nothing.
func checkAnswer(o outcome, dup *seededKey) string {
	switch {
	case o.err != nil:
		return o.err.Error()
	case o.status != http.StatusCreated:
		return fmt.Sprintf("status %d: %.200s", o.status, o.body)
	case dup != nil && dup.answer != nil && !bytes.Equal(o.body, dup.answer):
		return fmt.Sprintf("a duplicate of %s was answered %q, the first delivery %q", dup.id, o.body, dup.answer)
	}
	return ""
}

// slot drives rc with conc senders for d. With res nil nothing is
// recorded (warm-up).
func slot(ctx context.Context, rc *receiver, m mix, conc, bodySize int, d time.Duration, res *mixResult, seed uint64) {
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		lats = make([][]time.Duration, conc)
	)
	var errs, reqs int64
	var firstErr string
	runtime.GC() // the previous receiver's garbage is not this one's to collect
	before := readAllocs()
	cpu0 := readCPU()
	start := time.Now()
	deadline := start.Add(d)
	for w := 0; w < conc; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(seed, uint64(w)))
			var buf bytes.Buffer
			lat := make([]time.Duration, 0, 256)
			var myErrs, myReqs int64
			var myFirst string
			for ctx.Err() == nil && time.Now().Before(deadline) {
				var (
					eventID string
					body    []byte
					dup     *seededKey
					path    = "new"
				)
				if m.dupShare > 0 && len(rc.seeded) > 0 && (m.dupShare >= 1 || rng.Float64() < m.dupShare) {
					dup = &rc.seeded[rng.IntN(len(rc.seeded))]
					eventID, body, path = dup.id, dup.body, "dup"
				} else {
					eventID = rc.prefix + strconv.FormatInt(rc.seq.Add(1), 10)
					body = sendBody(eventID, bodySize)
				}
				t0 := time.Now()
				o := post(ctx, rc, eventID, path, body, &buf)
				lat = append(lat, time.Since(t0))
				myReqs++
				if msg := checkAnswer(o, dup); msg != "" && ctx.Err() == nil {
					myErrs++
					if myFirst == "" {
						myFirst = msg
					}
				}
			}
			mu.Lock()
			lats[w] = lat
			errs += myErrs
			reqs += myReqs
			if firstErr == "" {
				firstErr = myFirst
			}
			mu.Unlock()
		}(w)
	}
	wg.Wait()
	elapsed := time.Since(start)
	cpu1 := readCPU()
	after := readAllocs()
	if res == nil {
		return
	}
	res.requests += reqs
	res.errors += errs
	res.elapsed += elapsed
	res.allocBytes += after[0] - before[0]
	res.allocObjs += after[1] - before[1]
	res.cpu.self += cpu1.self - cpu0.self
	res.cpu.machine += cpu1.machine - cpu0.machine
	if res.firstErr == "" {
		res.firstErr = firstErr
	}
	for _, l := range lats {
		res.lat = append(res.lat, l...)
	}
}

var allocMetrics = []metrics.Sample{{Name: "/gc/heap/allocs:bytes"}, {Name: "/gc/heap/allocs:objects"}}

// readAllocs returns the process's cumulative heap allocations: bytes and
// objects.
func readAllocs() [2]uint64 {
	s := slices.Clone(allocMetrics)
	metrics.Read(s)
	return [2]uint64{s[0].Value.Uint64(), s[1].Value.Uint64()}
}

// seedKeys completes n keys through rc (or through seeder, another
// instance sharing rc's tables, so that rc has never seen them), conc at a
// time, and keeps their first answers for checking the replays.
func seedKeys(ctx context.Context, rc, seeder *receiver, n, conc, bodySize int) error {
	if seeder == nil {
		seeder = rc
	}
	keys := make([]seededKey, n)
	for i := range keys {
		id := rc.prefix + "seed:" + strconv.Itoa(i)
		keys[i] = seededKey{id: id, body: sendBody(id, bodySize)}
	}
	if !rc.idempotent {
		rc.seeded = keys // bare and the floors: "duplicates" are only resent ids
		return nil
	}
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		fail error
		next = make(chan int)
	)
	for w := 0; w < conc; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var buf bytes.Buffer
			for i := range next {
				k := &keys[i]
				o := post(ctx, seeder, k.id, "seed", k.body, &buf)
				if msg := checkAnswer(o, nil); msg != "" {
					mu.Lock()
					if fail == nil {
						fail = fmt.Errorf("seeding %s through %s: %s", k.id, seeder.name, msg)
					}
					mu.Unlock()
					continue
				}
				k.answer = bytes.Clone(o.body)
			}
		}()
	}
	for i := range keys {
		next <- i
	}
	close(next)
	wg.Wait()
	if fail != nil {
		return fail
	}
	rc.seeded = keys
	return nil
}

// percentile returns the q-quantile (nearest rank) of sorted.
func percentile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(q*float64(len(sorted))+0.999999999) - 1
	i = min(max(i, 0), len(sorted)-1)
	return sorted[i]
}
