import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;

/**
 * Prints the JDK's own hashCode() of typed values, one per input line, so the tests can compare them with
 * the vectorised Python hashes. Input lines are "type value":
 * byte/short/int/long/boolean in decimal (or true/false), float/double as their raw IEEE bits in hex,
 * string as the hex of its UTF-8 bytes (so any Unicode text survives the pipe).
 */
public final class JavaHashCodes {
    public static void main(String[] args) throws Exception {
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.US_ASCII));
        StringBuilder out = new StringBuilder();
        String line;
        while ((line = in.readLine()) != null) {
            if (line.isEmpty()) {
                continue;
            }
            int space = line.indexOf(' ');
            String type = space < 0 ? line : line.substring(0, space);
            String value = space < 0 ? "" : line.substring(space + 1);
            Object key;
            switch (type) {
                case "byte": key = Byte.valueOf(Byte.parseByte(value)); break;
                case "short": key = Short.valueOf(Short.parseShort(value)); break;
                case "int": key = Integer.valueOf(Integer.parseInt(value)); break;
                case "long": key = Long.valueOf(Long.parseLong(value)); break;
                case "boolean": key = Boolean.valueOf(value); break;
                case "float": key = Float.valueOf(Float.intBitsToFloat(Integer.parseUnsignedInt(value, 16))); break;
                case "double": key = Double.valueOf(Double.longBitsToDouble(Long.parseUnsignedLong(value, 16))); break;
                case "string": key = new String(unhex(value), StandardCharsets.UTF_8); break;
                default: throw new IllegalArgumentException("unknown type " + type);
            }
            out.append(key.hashCode()).append('\n');
        }
        System.out.print(out);
    }

    private static byte[] unhex(String hex) {
        byte[] bytes = new byte[hex.length() / 2];
        for (int i = 0; i < bytes.length; i++) {
            bytes[i] = (byte) Integer.parseInt(hex.substring(2 * i, 2 * i + 2), 16);
        }
        return bytes;
    }
}
