package idem

import (
	"bytes"
	"encoding/json"
	"errors"
	"net/http"
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

// parseHeaderJSON reads what appendHeaderJSON wrote (after jsonb has
// normalized it).
func parseHeaderJSON(b []byte) (http.Header, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil, errHeaderJSON
	}
	h := make(http.Header, 2)
	for dec.More() {
		tok, err := dec.Token()
		name, ok := tok.(string)
		if err != nil || !ok {
			return nil, errHeaderJSON
		}
		if tok, err := dec.Token(); err != nil || tok != json.Delim('[') {
			return nil, errHeaderJSON
		}
		var vs []string
		for dec.More() {
			tok, err := dec.Token()
			v, ok := tok.(string)
			if err != nil || !ok {
				return nil, errHeaderJSON
			}
			vs = append(vs, v)
		}
		if _, err := dec.Token(); err != nil { // ]
			return nil, errHeaderJSON
		}
		h[name] = vs
	}
	if _, err := dec.Token(); err != nil { // }
		return nil, errHeaderJSON
	}
	return h, nil
}
