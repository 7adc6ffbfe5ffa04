package idem

import (
	"bytes"
	"errors"
	"net/http"
	"unicode/utf16"
	"unicode/utf8"
)

// The replayed headers are stored in response_headers as a JSON object of
// arrays, {"Content-Type":["application/json"]}, written and read here
// without reflection: this runs on every completed request.

// appendHeaderJSON appends the headers of h named in names, in that order,
// as a JSON object. Values that jsonb cannot hold (with a NUL byte) are not
// stored; invalid UTF-8 becomes U+FFFD, as encoding/json does.
func appendHeaderJSON(dst []byte, h http.Header, names []string) []byte {
	dst = append(dst, '{')
	first := true
	for _, name := range names {
		vs, ok := h[name]
		if !ok {
			continue
		}
		if !first {
			dst = append(dst, ',')
		}
		first = false
		dst = appendJSONString(dst, name)
		dst = append(dst, ':', '[')
		n := 0
		for _, v := range vs {
			if bytes.IndexByte([]byte(v), 0) >= 0 {
				continue
			}
			if n > 0 {
				dst = append(dst, ',')
			}
			n++
			dst = appendJSONString(dst, v)
		}
		dst = append(dst, ']')
	}
	return append(dst, '}')
}

const hexDigits = "0123456789abcdef"

func appendJSONString(dst []byte, s string) []byte {
	dst = append(dst, '"')
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			switch {
			case c == '"' || c == '\\':
				dst = append(dst, '\\', c)
			case c < 0x20:
				dst = append(dst, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
			default:
				dst = append(dst, c)
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			dst = append(dst, `\ufffd`...)
		} else {
			dst = append(dst, s[i:i+size]...)
		}
		i += size
	}
	return append(dst, '"')
}

var errHeaderJSON = errors.New("idem: stored headers are not a JSON object of string arrays")

// parseHeaderJSON reads what appendHeaderJSON wrote, after jsonb has
// normalized it (any JSON whitespace is accepted). A small scanner, not
// encoding/json: this runs on every replay from the database.
func parseHeaderJSON(b []byte) (http.Header, error) {
	if !utf8.Valid(b) { // jsonb only ever holds valid UTF-8
		return nil, errHeaderJSON
	}
	p := headerScanner{b: b}
	if !p.consume('{') {
		return nil, errHeaderJSON
	}
	h := make(http.Header, 2)
	if p.consume('}') {
		return h, p.end()
	}
	for {
		name, ok := p.str()
		if !ok || !p.consume(':') || !p.consume('[') {
			return nil, errHeaderJSON
		}
		var vs []string
		if !p.consume(']') {
			for {
				v, ok := p.str()
				if !ok {
					return nil, errHeaderJSON
				}
				vs = append(vs, v)
				if p.consume(']') {
					break
				}
				if !p.consume(',') {
					return nil, errHeaderJSON
				}
			}
		}
		h[name] = vs
		if p.consume('}') {
			return h, p.end()
		}
		if !p.consume(',') {
			return nil, errHeaderJSON
		}
	}
}

type headerScanner struct {
	b []byte
	i int
}

func (p *headerScanner) skipSpace() {
	for p.i < len(p.b) && (p.b[p.i] == ' ' || p.b[p.i] == '\t' || p.b[p.i] == '\n' || p.b[p.i] == '\r') {
		p.i++
	}
}

// consume skips white space and the byte c, if c is next.
func (p *headerScanner) consume(c byte) bool {
	p.skipSpace()
	if p.i < len(p.b) && p.b[p.i] == c {
		p.i++
		return true
	}
	return false
}

func (p *headerScanner) end() error {
	p.skipSpace()
	if p.i != len(p.b) {
		return errHeaderJSON
	}
	return nil
}

// str reads a JSON string. Strings without escapes (nearly all header
// values) cost one allocation.
func (p *headerScanner) str() (string, bool) {
	if !p.consume('"') {
		return "", false
	}
	start := p.i
	for p.i < len(p.b) {
		switch c := p.b[p.i]; {
		case c == '"':
			s := string(p.b[start:p.i])
			p.i++
			return s, true
		case c == '\\':
			return p.escapedStr(start)
		case c < 0x20:
			return "", false
		default:
			p.i++
		}
	}
	return "", false
}

// escapedStr finishes a string that has escapes, from its start.
func (p *headerScanner) escapedStr(start int) (string, bool) {
	out := append([]byte(nil), p.b[start:p.i]...)
	for p.i < len(p.b) {
		c := p.b[p.i]
		switch {
		case c == '"':
			p.i++
			return string(out), true
		case c < 0x20:
			return "", false
		case c != '\\':
			out = append(out, c)
			p.i++
			continue
		}
		if p.i+1 >= len(p.b) {
			return "", false
		}
		e := p.b[p.i+1]
		p.i += 2
		switch e {
		case '"', '\\', '/':
			out = append(out, e)
		case 'b':
			out = append(out, '\b')
		case 'f':
			out = append(out, '\f')
		case 'n':
			out = append(out, '\n')
		case 'r':
			out = append(out, '\r')
		case 't':
			out = append(out, '\t')
		case 'u':
			r, ok := p.hex4()
			if !ok {
				return "", false
			}
			if utf16.IsSurrogate(r) {
				r2 := rune(-1)
				if p.i+1 < len(p.b) && p.b[p.i] == '\\' && p.b[p.i+1] == 'u' {
					save := p.i
					p.i += 2
					var ok2 bool
					if r2, ok2 = p.hex4(); !ok2 {
						return "", false
					}
					if utf16.DecodeRune(r, r2) == utf8.RuneError {
						p.i, r2 = save, -1 // not a pair: the second escape stands alone
					}
				}
				if r2 < 0 {
					r = utf8.RuneError
				} else {
					r = utf16.DecodeRune(r, r2)
				}
			}
			out = utf8.AppendRune(out, r)
		default:
			return "", false
		}
	}
	return "", false
}

func (p *headerScanner) hex4() (rune, bool) {
	if p.i+4 > len(p.b) {
		return 0, false
	}
	var r rune
	for _, c := range p.b[p.i : p.i+4] {
		var d byte
		switch {
		case c >= '0' && c <= '9':
			d = c - '0'
		case c >= 'a' && c <= 'f':
			d = c - 'a' + 10
		case c >= 'A' && c <= 'F':
			d = c - 'A' + 10
		default:
			return 0, false
		}
		r = r<<4 | rune(d)
	}
	p.i += 4
	return r, true
}
