// Package pgcluster runs throwaway PostgreSQL clusters on this machine, for
// the tests that need a server of their own: a primary with a streaming
// standby, failed over; a primary whose synchronous standby is away. Tests
// only: the library never imports it.
//
// The clusters live in one temporary directory, listen on 127.0.0.1 on free
// ports, and run as the user "postgres" when the tests run as root (initdb
// refuses root). Set.Close stops every server it started and removes the
// directory; call it even when a test fails.
package pgcluster

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver
)

// DefaultBinDir is where Debian's postgresql-15 package installs the server
// binaries; IDEM_PG_BINDIR overrides it.
const DefaultBinDir = "/usr/lib/postgresql/15/bin"

// ErrNotInstalled is BinDir's error when the server binaries are missing;
// a test that needs them fails with it.
var ErrNotInstalled = errors.New("pgcluster: the PostgreSQL server binaries are not installed")

// BinDir returns the directory of initdb, pg_ctl, pg_basebackup and
// postgres: IDEM_PG_BINDIR, else DefaultBinDir. The error wraps
// ErrNotInstalled when one of them is missing.
func BinDir() (string, error) {
	dir := os.Getenv("IDEM_PG_BINDIR")
	if dir == "" {
		dir = DefaultBinDir
	}
	for _, b := range []string{"initdb", "pg_ctl", "pg_basebackup", "postgres"} {
		if _, err := os.Stat(filepath.Join(dir, b)); err != nil {
			return "", fmt.Errorf("%w: %w (set IDEM_PG_BINDIR)", ErrNotInstalled, err)
		}
	}
	return dir, nil
}

// opTimeout bounds each server operation (start, stop, promote, backup).
const opTimeout = 30 * time.Second

// Set is a group of clusters in one temporary directory, made from one
// initdb.
type Set struct {
	bin, root, template string
	asUser              *user.User // run the server as this user; nil: as ourselves
	watchdog            *exec.Cmd  // cleans up if this process dies first

	mu       sync.Mutex
	clusters []*Cluster
}

// NewSet makes the temporary directory and an initdb template that every
// cluster of the set copies (initdb is the slow part).
func NewSet() (*Set, error) {
	bin, err := BinDir()
	if err != nil {
		return nil, err
	}
	s := &Set{bin: bin}
	if s.asUser, err = ServerUser(); err != nil {
		return nil, err
	}
	if s.root, err = os.MkdirTemp("", "idem-pgcluster-"); err != nil {
		return nil, err
	}
	if err := s.chown(s.root); err != nil {
		_ = os.RemoveAll(s.root)
		return nil, err
	}
	if err := s.startWatchdog(); err != nil {
		_ = os.RemoveAll(s.root)
		return nil, err
	}
	s.template = filepath.Join(s.root, "template")
	if _, err := s.run("initdb", "-D", s.template, "-U", "postgres", "--auth=trust", "--no-sync", "--no-instructions"); err != nil {
		_ = s.Close()
		return nil, err
	}
	return s, nil
}

// watchdogScript stops the servers of the directory $1 (SIGQUIT to a
// postmaster is an immediate shutdown) and removes it once the process $2
// is gone.
const watchdogScript = `while kill -0 "$2" 2>/dev/null; do sleep 1; done
for f in "$1"/*/postmaster.pid; do [ -f "$f" ] && kill -QUIT "$(head -n 1 "$f")" 2>/dev/null; done
sleep 2
rm -rf "$1"`

// startWatchdog starts a shell, in a process group of its own, that cleans
// up after this process if it dies without calling Close (a test binary
// killed by its -timeout, or by a signal): no server outlives the tests.
func (s *Set) startWatchdog() (err error) {
	s.watchdog, err = StartWatchdog(watchdogScript, s.root)
	return err
}

// StartWatchdog starts the shell script, in a process group of its own,
// with the directory dir as $1 and this process's id as $2: a script that
// waits for this process to end, then stops what it started in dir and
// removes dir. Kill the returned command once cleaned up normally.
func StartWatchdog(script, dir string) (*exec.Cmd, error) {
	cmd := exec.Command("sh", "-c", script, "watchdog", dir, strconv.Itoa(os.Getpid()))
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	return cmd, nil
}

func (s *Set) chown(path string) error { return Chown(s.asUser, path) }

// ServerUser is the user to run PostgreSQL's servers as: "postgres" when
// this process runs as root (initdb refuses root), else nil: ourselves.
func ServerUser() (*user.User, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, fmt.Errorf("pgcluster: running as root, and initdb refuses root: %w", err)
	}
	return u, nil
}

// Chown gives path to u (from ServerUser); nothing when u is nil.
func Chown(u *user.User, path string) error {
	if u == nil {
		return nil
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	return os.Chown(path, uid, gid)
}

// run runs one of the server binaries as the server's user and returns its
// output.
func (s *Set) run(name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	path := filepath.Join(s.bin, name)
	var cmd *exec.Cmd
	if s.asUser != nil {
		cmd = exec.CommandContext(ctx, "runuser", append([]string{"-u", s.asUser.Username, "--", path}, args...)...)
	} else {
		cmd = exec.CommandContext(ctx, path, args...)
	}
	cmd.Dir = s.root
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("pgcluster: %s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(out.String()))
	}
	return out.String(), nil
}

// Close stops every cluster still running (immediately: nothing of theirs
// is kept) and removes the set's directory.
func (s *Set) Close() error {
	s.mu.Lock()
	clusters := append([]*Cluster(nil), s.clusters...)
	s.mu.Unlock()
	var errs []error
	for _, c := range clusters {
		if err := c.Kill(); err != nil {
			errs = append(errs, err)
		}
	}
	if err := os.RemoveAll(s.root); err != nil {
		errs = append(errs, err)
	}
	if s.watchdog != nil {
		_ = s.watchdog.Process.Kill()
		_ = s.watchdog.Wait()
	}
	return errors.Join(errs...)
}

// Cluster is one PostgreSQL server of a Set.
type Cluster struct {
	Name string // also its application_name as a standby
	Port int
	Dir  string // the data directory

	s       *Set
	running bool
	paused  []int // processes stopped with SIGSTOP
}

// FreePort returns a TCP port on 127.0.0.1 that nothing listens on.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// conf is the configuration every cluster starts with: small, local, fast.
// fsync is off: the tests kill servers, never the machine, and the kernel
// keeps what a killed process wrote.
func (c *Cluster) conf(extra []string) string {
	lines := []string{
		"port = " + strconv.Itoa(c.Port),
		"listen_addresses = '127.0.0.1'",
		"unix_socket_directories = '" + c.Dir + "'",
		"max_connections = 40",
		"shared_buffers = 16MB",
		"fsync = off",
		"max_wal_senders = 4",
		"wal_level = replica",
		"hot_standby = on",
		"logging_collector = off",
		"log_min_messages = warning",
	}
	return "\n# pgcluster\n" + strings.Join(append(lines, extra...), "\n") + "\n"
}

// Primary makes a new cluster from the set's template and starts it. conf
// lines are appended to its postgresql.conf ("synchronous_commit = on").
func (s *Set) Primary(name string, conf ...string) (*Cluster, error) {
	c, err := s.newCluster(name)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command("cp", "-a", s.template, c.Dir)
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("pgcluster: copy the template: %w: %s", err, out)
	}
	if err := c.appendConf(c.conf(conf)); err != nil {
		return nil, err
	}
	return c, c.Start()
}

// Standby makes a new cluster from a base backup of c and starts it as a
// streaming standby of c, named name (its application_name, for
// synchronous_standby_names). conf lines are appended to its
// postgresql.conf; what c's postgresql.auto.conf says (ALTER SYSTEM) is
// copied too.
func (c *Cluster) Standby(name string, conf ...string) (*Cluster, error) {
	sb, err := c.s.newCluster(name)
	if err != nil {
		return nil, err
	}
	if _, err := c.s.run("pg_basebackup", "-D", sb.Dir, "-h", "127.0.0.1", "-p", strconv.Itoa(c.Port),
		"-U", "postgres", "-X", "stream", "--no-sync", "-c", "fast"); err != nil {
		return nil, err
	}
	conninfo := fmt.Sprintf("host=127.0.0.1 port=%d user=postgres application_name=%s", c.Port, name)
	conf = append([]string{"primary_conninfo = '" + conninfo + "'"}, conf...)
	if err := sb.appendConf(sb.conf(conf)); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(sb.Dir, "standby.signal"), nil, 0o600); err != nil {
		return nil, err
	}
	if err := c.s.chown(filepath.Join(sb.Dir, "standby.signal")); err != nil {
		return nil, err
	}
	return sb, sb.Start()
}

func (s *Set) newCluster(name string) (*Cluster, error) {
	port, err := FreePort()
	if err != nil {
		return nil, err
	}
	c := &Cluster{Name: name, Port: port, Dir: filepath.Join(s.root, name), s: s}
	s.mu.Lock()
	s.clusters = append(s.clusters, c)
	s.mu.Unlock()
	return c, nil
}

func (c *Cluster) appendConf(text string) error {
	f, err := os.OpenFile(filepath.Join(c.Dir, "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	if _, err := f.WriteString(text); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

// Start starts the server and waits until it accepts connections.
func (c *Cluster) Start() error {
	_, err := c.s.run("pg_ctl", "-D", c.Dir, "-l", filepath.Join(c.s.root, c.Name+".log"), "-w", "-t", "30", "start")
	c.running = err == nil
	return err
}

// Log returns the server's log so far, for a failing test to show.
func (c *Cluster) Log() string {
	b, _ := os.ReadFile(filepath.Join(c.s.root, c.Name+".log"))
	return string(b)
}

// Stop stops the server in mode ("fast", "immediate") and waits until it
// is gone. "immediate" is a crash: no checkpoint, and sessions are not told.
// Processes paused with Pause are killed first (a stopped process would
// hold up the shutdown), so nothing they would have sent gets out.
func (c *Cluster) Stop(mode string) error {
	if !c.running {
		return nil
	}
	pid, err := c.postmasterPID()
	if err != nil {
		return err
	}
	if _, err := c.s.run("pg_ctl", "-D", c.Dir, "-m", mode, "-W", "stop"); err != nil {
		return err
	}
	for _, p := range c.paused {
		_ = syscall.Kill(p, syscall.SIGKILL)
	}
	c.paused = nil
	// The postmaster removes its pid file as it exits (the process may stay
	// a zombie for a while: it is not our child).
	deadline := time.Now().Add(opTimeout)
	for c.pidFileNames(pid) { // no event to await: poll, bounded
		if time.Now().After(deadline) {
			return fmt.Errorf("pgcluster: %s did not stop within %v", c.Name, opTimeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
	c.running = false
	return nil
}

// Kill stops the server at once, if it runs.
func (c *Cluster) Kill() error { return c.Stop("immediate") }

// pidFileNames reports whether postmaster.pid still names pid.
func (c *Cluster) pidFileNames(pid int) bool {
	p, err := c.postmasterPID()
	return err == nil && p == pid
}

func (c *Cluster) postmasterPID() (int, error) {
	b, err := os.ReadFile(filepath.Join(c.Dir, "postmaster.pid"))
	if err != nil {
		return 0, err
	}
	first, _, _ := strings.Cut(string(b), "\n")
	return strconv.Atoi(strings.TrimSpace(first))
}

// Promote promotes a standby and waits until it accepts writes.
func (c *Cluster) Promote() error {
	_, err := c.s.run("pg_ctl", "-D", c.Dir, "-w", "-t", "30", "promote")
	return err
}

// Pause stops a process of this server with SIGSTOP (a walsender, to hold
// back the WAL a standby receives), until Resume or Stop.
func (c *Cluster) Pause(pid int) error {
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		return err
	}
	c.paused = append(c.paused, pid)
	return nil
}

// Resume lets the processes paused with Pause go on.
func (c *Cluster) Resume() error {
	var errs []error
	for _, p := range c.paused {
		errs = append(errs, syscall.Kill(p, syscall.SIGCONT))
	}
	c.paused = nil
	return errors.Join(errs...)
}

// URL is a URL for database db of this cluster, as user postgres.
func (c *Cluster) URL(db string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", c.Port, db)
}

// Open opens a database/sql pool on database db of this cluster.
func (c *Cluster) Open(db string) (*sql.DB, error) { return sql.Open("pgx", c.URL(db)) }

// MultiHostURL is the URL of a client that fails over between the clusters:
// it connects to the first of them that accepts writes.
func MultiHostURL(db string, clusters ...*Cluster) string {
	hosts := make([]string, len(clusters))
	for i, c := range clusters {
		hosts[i] = "127.0.0.1:" + strconv.Itoa(c.Port)
	}
	return fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable&target_session_attrs=read-write&connect_timeout=5",
		strings.Join(hosts, ","), db)
}
