//go:build hatest

package hatest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/pgidem/idem/internal/pgcluster"
	"github.com/pgidem/idem/internal/testdb"
	"github.com/stretchr/testify/require"
)

// monitorSettings bound an unplanned failover (about 55 s with the
// defaults: a node is unhealthy after 20 s, and the monitor waits 30 s for
// a lost primary to demote itself) to a few seconds: health checks every
// second, one retry, a node unhealthy after 3 s, a lost primary given 3 s.
var monitorSettings = []string{
	"health_check_period = 1000",
	"health_check_timeout = 1000",
	"health_check_max_retries = 1",
	"health_check_retry_delay = 500",
	"node_considered_unhealthy_timeout = 3000",
	"primary_demote_timeout = 3000",
	"startup_grace_period = 2000",
}

// stateBound bounds each wait for the formation to reach a state.
const stateBound = 2 * time.Minute

// formation is a pg_auto_failover monitor and its data nodes, each a
// pg_autoctl process (with its PostgreSQL) in a process group of its own,
// all in one temporary directory, run as the user postgres when the test
// runs as root (initdb refuses root).
type formation struct {
	t        *testing.T
	dir      string
	bin      string     // PostgreSQL's server binaries
	asUser   *user.User // nil: as ourselves
	monitor  *member
	nodes    []*member
	monDB    *sql.DB // the monitor's database, as postgres
	mu       sync.Mutex
	members  []*member
	watchdog *exec.Cmd
}

// member is one pg_autoctl process and its PostgreSQL.
type member struct {
	name, pgdata string
	port         int
	cmd          *exec.Cmd
	done         chan struct{}     // closed when cmd has exited
	log          *testdb.LogBuffer // what pg_autoctl printed
}

// newFormation starts a monitor with monitorSettings and two nodes, and
// returns once one is primary and the other its synchronous secondary.
// Everything is stopped and removed when the test ends.
func newFormation(t *testing.T) *formation {
	t.Helper()
	if _, err := exec.LookPath("pg_autoctl"); err != nil {
		t.Fatalf("pg_autoctl is not installed (run scripts/ensure-autofailover.sh): %v", err)
	}
	bin, err := pgcluster.BinDir()
	require.NoError(t, err)
	f := &formation{t: t, bin: bin}
	f.asUser, err = pgcluster.ServerUser()
	require.NoError(t, err)
	f.dir, err = os.MkdirTemp("", "idem-hatest-")
	require.NoError(t, err)
	require.NoError(t, pgcluster.Chown(f.asUser, f.dir))
	for _, d := range []string{"config", "data", "run"} { // pg_autoctl's (command), else it writes to /tmp
		require.NoError(t, os.Mkdir(filepath.Join(f.dir, d), 0o700))
		require.NoError(t, pgcluster.Chown(f.asUser, filepath.Join(f.dir, d)))
	}
	f.watchdog, err = pgcluster.StartWatchdog(watchdogScript, f.dir)
	require.NoError(t, err)
	t.Cleanup(f.close)

	f.monitor = f.newMember("monitor")
	f.create(f.monitor, "create", "monitor", "--auth", "trust", "--no-ssl")
	f.monDB, err = sql.Open("pgx", fmt.Sprintf("postgres://postgres@127.0.0.1:%d/pg_auto_failover?sslmode=disable", f.monitor.port))
	require.NoError(t, err)
	f.await("the monitor to accept connections", func() (bool, error) { return f.monDB.Ping() == nil, nil })
	for _, s := range monitorSettings {
		_, err := f.monDB.Exec("ALTER SYSTEM SET pgautofailover." + s)
		require.NoError(t, err)
	}
	_, err = f.monDB.Exec("SELECT pg_reload_conf()")
	require.NoError(t, err)

	monitorURL := fmt.Sprintf("postgres://autoctl_node@127.0.0.1:%d/pg_auto_failover?sslmode=disable", f.monitor.port)
	for i, name := range []string{"node1", "node2"} {
		n := f.newMember(name)
		f.nodes = append(f.nodes, n)
		f.create(n, "create", "postgres", "--name", name, "--monitor", monitorURL, "--auth", "trust", "--no-ssl")
		want := map[string]string{"node1": "single"}
		if i == 1 {
			want = map[string]string{"node1": "primary", "node2": "secondary"}
		}
		f.awaitStates(want)
	}
	return f
}

// watchdogScript stops the process groups listed in $1/pgids and the
// postmasters of $1 (SIGQUIT: an immediate stop of pg_autoctl and of
// PostgreSQL), kills what is left, and removes the directory $1 once the
// process $2 is gone: nothing outlives a test binary killed by its
// -timeout or a signal.
const watchdogScript = `while kill -0 "$2" 2>/dev/null; do sleep 1; done
for g in $(cat "$1/pgids" 2>/dev/null); do kill -QUIT -- "-$g" 2>/dev/null; done
for f in "$1"/*/postmaster.pid; do [ -f "$f" ] && kill -QUIT "$(head -n 1 "$f")" 2>/dev/null; done
sleep 3
for g in $(cat "$1/pgids" 2>/dev/null); do kill -KILL -- "-$g" 2>/dev/null; done
rm -rf "$1"`

// newMember names a member and gives it a free port.
func (f *formation) newMember(name string) *member {
	port, err := pgcluster.FreePort()
	require.NoError(f.t, err)
	return &member{name: name, pgdata: filepath.Join(f.dir, name), port: port, log: new(testdb.LogBuffer)}
}

// command is pg_autoctl args, as the server's user, with the formation's
// directories for its configuration, state and pid files.
func (f *formation) command(ctx context.Context, args ...string) *exec.Cmd {
	env := []string{
		"PATH=" + f.bin + ":" + os.Getenv("PATH"),
		"XDG_CONFIG_HOME=" + filepath.Join(f.dir, "config"),
		"XDG_DATA_HOME=" + filepath.Join(f.dir, "data"),
		"XDG_RUNTIME_DIR=" + filepath.Join(f.dir, "run"),
		"HOME=" + f.dir,
	}
	var cmd *exec.Cmd
	if f.asUser != nil {
		cmd = exec.CommandContext(ctx, "runuser", append(append([]string{"-u", f.asUser.Username, "--", "env"}, env...), append([]string{"pg_autoctl"}, args...)...)...)
	} else {
		cmd = exec.CommandContext(ctx, "pg_autoctl", args...)
		cmd.Env = append(os.Environ(), env...)
	}
	cmd.Dir = f.dir
	return cmd
}

// create runs "pg_autoctl <args> --run" for m, which creates it and then
// runs it, in a process group of its own, until the test ends or kill.
func (f *formation) create(m *member, args ...string) {
	args = append(args, "--pgdata", m.pgdata, "--pgport", strconv.Itoa(m.port), "--hostname", "127.0.0.1", "--run")
	f.start(m, args...)
}

// start starts pg_autoctl args for m in a process group of its own.
func (f *formation) start(m *member, args ...string) {
	f.t.Helper()
	m.cmd = f.command(context.Background(), args...)
	m.cmd.Stdout, m.cmd.Stderr = m.log, m.log
	m.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	require.NoError(f.t, m.cmd.Start())
	m.done = make(chan struct{})
	go func(cmd *exec.Cmd, done chan struct{}) {
		_ = cmd.Wait()
		close(done)
	}(m.cmd, m.done)
	f.mu.Lock()
	f.members = append(f.members, m)
	f.mu.Unlock()
	pgids, err := os.OpenFile(filepath.Join(f.dir, "pgids"), os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o600)
	require.NoError(f.t, err)
	_, err = fmt.Fprintln(pgids, m.cmd.Process.Pid)
	require.NoError(f.t, errors.Join(err, pgids.Close()))
}

// kill kills m's whole process group at once, pg_autoctl and PostgreSQL,
// and the postmaster too if it runs in a group of its own: the machine is
// gone, as far as the formation can tell. The shared memory segment the
// postmaster leaves is removed.
func (f *formation) kill(m *member) {
	f.t.Helper()
	pid, shmid := postmaster(m)
	require.NoError(f.t, syscall.Kill(-m.cmd.Process.Pid, syscall.SIGKILL))
	if pid > 0 {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
	<-m.done
	if shmid != "" {
		_ = exec.Command("ipcrm", "-m", shmid).Run() // gone already if nothing was attached
	}
}

// postmaster returns the pid and the shared memory segment's id in m's
// postmaster.pid, or 0 and "".
func postmaster(m *member) (pid int, shmid string) {
	b, err := os.ReadFile(filepath.Join(m.pgdata, "postmaster.pid"))
	if err != nil {
		return 0, ""
	}
	lines := strings.Split(string(b), "\n")
	pid, _ = strconv.Atoi(strings.TrimSpace(lines[0]))
	if len(lines) > 6 {
		if f := strings.Fields(lines[6]); len(f) == 2 {
			shmid = f[1]
		}
	}
	return pid, shmid
}

// stop stops m: SIGQUIT to its process group is an immediate stop of
// pg_autoctl and of PostgreSQL (which then removes its shared memory);
// SIGKILL if that has not ended it within 10 s.
func stop(m *member) {
	select {
	case <-m.done:
		return
	default:
	}
	pid, _ := postmaster(m)
	_ = syscall.Kill(-m.cmd.Process.Pid, syscall.SIGQUIT)
	if pid > 0 {
		_ = syscall.Kill(pid, syscall.SIGQUIT)
	}
	select {
	case <-m.done:
	case <-time.After(10 * time.Second):
		_ = syscall.Kill(-m.cmd.Process.Pid, syscall.SIGKILL)
		if pid > 0 {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		<-m.done
	}
}

// close stops every member, showing their logs if the test failed, and
// removes the directory.
func (f *formation) close() {
	if f.monDB != nil {
		_ = f.monDB.Close()
	}
	f.mu.Lock()
	members := append([]*member(nil), f.members...)
	f.mu.Unlock()
	var wg sync.WaitGroup
	for i := len(members) - 1; i >= 0; i-- { // the nodes first, the monitor last
		wg.Add(1)
		go func(m *member) { defer wg.Done(); stop(m) }(members[i])
	}
	wg.Wait()
	if f.t.Failed() {
		for _, m := range members {
			f.t.Logf("pg_autoctl log of %s:\n%s", m.name, tail(m.log.String(), 60))
		}
	}
	if err := os.RemoveAll(f.dir); err != nil {
		f.t.Errorf("remove %s: %v", f.dir, err)
	}
	if f.watchdog != nil {
		_ = f.watchdog.Process.Kill()
		_ = f.watchdog.Wait()
	}
}

// tail is the last n lines of s.
func tail(s string, n int) string {
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// states returns each node's reported and assigned state, by name.
func (f *formation) states() (map[string][2]string, error) {
	rows, err := f.monDB.Query(`SELECT nodename, reportedstate::text, goalstate::text FROM pgautofailover.node`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[string][2]string{}
	for rows.Next() {
		var name, reported, goal string
		if err := rows.Scan(&name, &reported, &goal); err != nil {
			return nil, err
		}
		out[name] = [2]string{reported, goal}
	}
	return out, rows.Err()
}

// awaitStates waits until each named node reports, and is assigned, its
// state.
func (f *formation) awaitStates(want map[string]string) {
	f.t.Helper()
	f.await(fmt.Sprintf("the nodes to reach %v", want), func() (bool, error) {
		got, err := f.states()
		if err != nil {
			return false, nil // the monitor may be starting
		}
		for name, state := range want {
			if got[name] != [2]string{state, state} {
				return false, nil
			}
		}
		return true, nil
	})
}

// await polls cond (the formation offers no event to wait on) until it
// holds, failing the test after stateBound or if a member exits.
func (f *formation) await(what string, cond func() (bool, error)) {
	f.t.Helper()
	deadline := time.Now().Add(stateBound)
	for {
		ok, err := cond()
		require.NoError(f.t, err, what)
		if ok {
			return
		}
		if time.Now().After(deadline) {
			states, _ := f.states()
			f.t.Fatalf("gave up waiting %v for %s (states: %v); the monitor's last events:\n%s", stateBound, what, states, f.events())
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// events returns the monitor's last events, newest last, for a failing
// test to show.
func (f *formation) events() string {
	rows, err := f.monDB.Query(`SELECT eventtime::time(0)::text, nodename, description
FROM (SELECT * FROM pgautofailover.event ORDER BY eventid DESC LIMIT 30) e ORDER BY eventid`)
	if err != nil {
		return err.Error()
	}
	defer rows.Close()
	var b strings.Builder
	for rows.Next() {
		var at, node, what string
		if err := rows.Scan(&at, &node, &what); err != nil {
			return err.Error()
		}
		fmt.Fprintf(&b, "%s %s: %s\n", at, node, what)
	}
	return b.String()
}

// primary returns the node the monitor has as primary (or wait_primary).
func (f *formation) primary() *member {
	f.t.Helper()
	got, err := f.states()
	require.NoError(f.t, err)
	for _, n := range f.nodes {
		if s := got[n.name][0]; s == "primary" || s == "wait_primary" {
			return n
		}
	}
	f.t.Fatalf("no primary: %v", got)
	return nil
}

// other is the node that is not n.
func (f *formation) other(n *member) *member {
	if f.nodes[0] == n {
		return f.nodes[1]
	}
	return f.nodes[0]
}

// switchover asks the monitor for a switchover, as pg_autoctl perform
// switchover does (pgautofailover.perform_failover), and returns once the
// secondary is primary and the old primary its secondary again (after
// pg_rewind).
func (f *formation) switchover() {
	f.t.Helper()
	old := f.primary()
	_, err := f.monDB.Exec(`SELECT pgautofailover.perform_failover('default', 0)`)
	require.NoError(f.t, err)
	f.awaitStates(map[string]string{f.other(old).name: "primary", old.name: "secondary"})
}

// url is a multi-host URL of the formation's nodes for database db, as
// pg_autoctl show uri prints it, with what idem needs added: a user, and
// connect_timeout, so that a node that does not answer does not hold up
// the connection to the other.
func (f *formation) url(db string) string {
	hosts := make([]string, len(f.nodes))
	for i, n := range f.nodes {
		hosts[i] = "127.0.0.1:" + strconv.Itoa(n.port)
	}
	return fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable&target_session_attrs=read-write&connect_timeout=2",
		strings.Join(hosts, ","), db)
}
