//! Network namespaces a test makes for itself: one per host, joined by a bridge in a namespace
//! of its own, and a veth from the test's namespace to that bridge, so the test reaches every
//! host at an address inside the namespaces it made. Everything is removed on drop. Where
//! namespaces cannot be made (no `ip`, no privilege), [`Netns::new`] panics saying why: the
//! test fails, it never skips.

use std::net::Ipv4Addr;
use std::process::Command;

/// The namespaces of one test.
pub struct Netns {
    tag: String,
    hosts: Vec<String>,
    subnet: u8,
    /// The test's end of its veth to the bridge.
    host_if: String,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running `ip {}`: {e} (the test needs iproute2)", args.join(" ")));
    assert!(
        out.status.success(),
        "`ip {}` failed: {} (the test makes network namespaces and veth pairs: it needs root or CAP_NET_ADMIN)",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

impl Netns {
    /// A namespace for each of `hosts`, on one bridge, at 10.213.S.2, .3, … in order (S from
    /// this process's id); the test's own end is 10.213.S.1.
    pub fn new(hosts: &[&str]) -> Netns {
        let pid = std::process::id();
        // Interface names hold at most 15 bytes: w, the pid (at most 7 digits), 3 more.
        let tag = format!("w{pid}");
        let subnet = (pid % 200) as u8 + 20;
        let n = Netns {
            hosts: hosts.iter().map(|h| h.to_string()).collect(),
            host_if: format!("{tag}h"),
            tag,
            subnet,
        };
        // What a killed run of a process with the same id left behind goes first.
        let _ = Command::new("ip").args(["link", "del", &n.host_if]).output();
        for h in hosts.iter().copied().chain(["sw"]) {
            let _ = Command::new("ip").args(["netns", "del", &n.ns(h)]).output();
        }
        let sw = n.ns("sw");
        ip(&["netns", "add", &sw]);
        ip(&["-n", &sw, "link", "set", "lo", "up"]);
        ip(&["-n", &sw, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &sw, "link", "set", "br0", "up"]);
        for (i, h) in hosts.iter().enumerate() {
            let ns = n.ns(h);
            ip(&["netns", "add", &ns]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
            let (inner, outer) = (format!("{}{i}a", n.tag), n.port(h));
            ip(&["link", "add", &inner, "type", "veth", "peer", "name", &outer]);
            ip(&["link", "set", &inner, "netns", &ns]);
            ip(&["link", "set", &outer, "netns", &sw]);
            ip(&["-n", &ns, "addr", "add", &format!("{}/24", n.addr(h)), "dev", &inner]);
            ip(&["-n", &ns, "link", "set", &inner, "up"]);
            ip(&["-n", &sw, "link", "set", &outer, "master", "br0"]);
            ip(&["-n", &sw, "link", "set", &outer, "up"]);
        }
        let outer = format!("{}hb", n.tag);
        ip(&["link", "add", &n.host_if, "type", "veth", "peer", "name", &outer]);
        ip(&["link", "set", &outer, "netns", &sw]);
        ip(&["-n", &sw, "link", "set", &outer, "master", "br0"]);
        ip(&["-n", &sw, "link", "set", &outer, "up"]);
        ip(&["addr", "add", &format!("10.213.{subnet}.1/24"), "dev", &n.host_if]);
        ip(&["link", "set", &n.host_if, "up"]);
        n
    }

    /// The namespace of `host` (or of the bridge, `sw`).
    pub fn ns(&self, host: &str) -> String {
        format!("{}-{host}", self.tag)
    }

    /// The address of `host`.
    pub fn addr(&self, host: &str) -> Ipv4Addr {
        let i = self
            .hosts
            .iter()
            .position(|h| h == host)
            .expect("a host of these namespaces");
        Ipv4Addr::new(10, 213, self.subnet, i as u8 + 2)
    }

    /// The test's own address, on the bridge.
    pub fn own_addr(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 213, self.subnet, 1)
    }

    /// The bridge's end of `host`'s veth.
    fn port(&self, host: &str) -> String {
        let i = self
            .hosts
            .iter()
            .position(|h| h == host)
            .expect("a host of these namespaces");
        format!("{}{i}b", self.tag)
    }

    /// Cuts `host` off the bridge (its link goes down; its processes keep running).
    pub fn cut(&self, host: &str) {
        ip(&["-n", &self.ns("sw"), "link", "set", &self.port(host), "down"]);
    }

    /// Puts `host` back on the bridge.
    pub fn restore(&self, host: &str) {
        ip(&["-n", &self.ns("sw"), "link", "set", &self.port(host), "up"]);
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth ends in it, and so their peers.
        let _ = Command::new("ip").args(["link", "del", &self.host_if]).output();
        for h in self.hosts.iter().map(String::as_str).chain(["sw"]) {
            let _ = Command::new("ip").args(["netns", "del", &self.ns(h)]).output();
        }
    }
}
