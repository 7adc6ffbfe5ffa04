package main

import (
	"bytes"
	"os"
	"strconv"
	"time"
)

// CPU accounting, per receiver and mix: the tool's own process (the
// senders and the receiver, whose Go code is what differs between
// receivers) and the rest of the machine (PostgreSQL, Redis for the peer,
// the kernel's work for both), read at the start and end of each measured
// slot. Per request, they tell where a receiver's time goes: what a
// receiver costs over another in Go, and what in the database.

// cpuSample is the CPU time used until now: by this process, and by the
// whole machine (every CPU's busy time, from /proc/stat; 0 where there is
// none).
type cpuSample struct {
	self, machine time.Duration
}

func readCPU() cpuSample {
	return cpuSample{self: processCPU(), machine: machineBusy()}
}

// clockTick is /proc/stat's unit, USER_HZ: 100 on every Linux that Go runs
// on.
const clockTick = 10 * time.Millisecond

// machineBusy is the busy time of all CPUs together, from the "cpu" line
// of /proc/stat: user, nice, system, irq and softirq (not idle or iowait;
// not steal, the time a hypervisor gave to other machines; not guest,
// which user already counts). It is every process's: what else runs on
// the machine counts as the rest too.
func machineBusy() time.Duration {
	b, err := os.ReadFile("/proc/stat")
	if err != nil || !bytes.HasPrefix(b, []byte("cpu ")) {
		return 0
	}
	line, _, _ := bytes.Cut(b, []byte("\n"))
	f := bytes.Fields(line)[1:] // user nice system idle iowait irq softirq steal guest guest_nice
	var busy int64
	for _, i := range []int{0, 1, 2, 5, 6} {
		if i < len(f) {
			v, err := strconv.ParseInt(string(f[i]), 10, 64)
			if err != nil {
				return 0
			}
			busy += v
		}
	}
	return time.Duration(busy) * clockTick
}
