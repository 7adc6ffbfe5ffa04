package main

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"

	modzip "golang.org/x/mod/zip"
)

// maxFileBytes is the largest file a module zip may hold: source files and
// test data are far smaller, and anything larger is most likely a build
// output or a data dump that users should not download.
const maxFileBytes = 1 << 20

// zipReport is what checkModule found in one module's zip.
type zipReport struct {
	files    int
	bytes    int64
	problems []string // "path: why", one per file that must not ship
}

// checkModule lists the files a zip of the module in dir would hold, the
// way the go command does (golang.org/x/mod/zip: no nested modules, no VCS
// directories, no vendored packages, no symbolic links), and reports every
// one that is a compiled binary, an executable that is not a script, or
// larger than maxFileBytes, and any file the go command would refuse.
func checkModule(dir string) (zipReport, error) {
	var r zipReport
	cf, err := modzip.CheckDir(dir)
	for _, fe := range cf.Invalid {
		r.problems = append(r.problems, rel(dir, fe.Path)+": "+fe.Err.Error())
	}
	if cf.SizeError != nil {
		r.problems = append(r.problems, cf.SizeError.Error())
	}
	if err != nil && len(r.problems) == 0 {
		return r, err
	}
	for _, p := range cf.Valid {
		info, err := os.Lstat(p)
		if err != nil {
			return r, err
		}
		r.files++
		r.bytes += info.Size()
		head, err := readHead(p)
		if err != nil {
			return r, err
		}
		if why := mustNotShip(info, head); why != "" {
			r.problems = append(r.problems, rel(dir, p)+": "+why)
		}
	}
	return r, nil
}

// mustNotShip says why a file with this mode and these first bytes must not
// be in a module zip, or "" when it may.
func mustNotShip(info os.FileInfo, head []byte) string {
	if format := binaryFormat(head); format != "" {
		return "a compiled " + format + " binary"
	}
	if info.Mode()&0o111 != 0 && !bytes.HasPrefix(head, []byte("#!")) {
		return "executable (mode " + info.Mode().String() + ") and not a script"
	}
	if info.Size() > maxFileBytes {
		return fmt.Sprintf("%d bytes, over the %d-byte limit for one file", info.Size(), maxFileBytes)
	}
	return ""
}

// binaryFormat names the executable format whose magic number starts head,
// or returns "".
func binaryFormat(head []byte) string {
	magics := []struct {
		format string
		magic  []byte
	}{
		{"ELF", []byte("\x7fELF")},
		{"Mach-O", []byte{0xfe, 0xed, 0xfa, 0xce}},
		{"Mach-O", []byte{0xfe, 0xed, 0xfa, 0xcf}},
		{"Mach-O", []byte{0xce, 0xfa, 0xed, 0xfe}},
		{"Mach-O", []byte{0xcf, 0xfa, 0xed, 0xfe}},
		{"Mach-O universal", []byte{0xca, 0xfe, 0xba, 0xbe}},
	}
	for _, m := range magics {
		if bytes.HasPrefix(head, m.magic) {
			return m.format
		}
	}
	// PE (Windows): "MZ", and the offset at 0x3c points at "PE\0\0".
	if len(head) >= 0x40 && bytes.HasPrefix(head, []byte("MZ")) {
		off := int(head[0x3c]) | int(head[0x3d])<<8
		if off+4 <= len(head) && bytes.Equal(head[off:off+4], []byte("PE\x00\x00")) {
			return "PE"
		}
	}
	return ""
}

// readHead returns the first 512 bytes of the file at p (fewer if it is
// shorter): enough for every magic number binaryFormat knows.
func readHead(p string) ([]byte, error) {
	f, err := os.Open(p)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	head := make([]byte, 512)
	n, err := io.ReadFull(f, head)
	if err == io.EOF || err == io.ErrUnexpectedEOF {
		err = nil
	}
	return head[:n], err
}

// rel returns p relative to dir, slash-separated, for messages.
func rel(dir, p string) string {
	if r, err := filepath.Rel(dir, p); err == nil {
		return filepath.ToSlash(r)
	}
	return p
}
